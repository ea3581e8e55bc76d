"""Tasks with verifiable rewards, generated in code, with a fixed held-out set.

- ``copy`` / ``reverse`` / ``sort`` (for TinyGPT): the prompt is ``BOS x_1 .. x_L SEP`` with symbols
  drawn from ``num_symbols`` values; the answer is the transformed sequence followed by ``EOS``. Reward
  ``partial`` = fraction of positions right (extra tokens count as wrong), or ``exact`` = 0/1.
- ``class_sort`` (for TinyGPT): the same prompts; symbol s belongs to class s // ``class_size``, and any
  answer that lists the prompt's symbols with their classes in ascending order is right, in whatever order
  the symbols of one class come. A prompt has many right answers, so a policy trained on a mix of them
  forks where a language model does: several good continuations at one position. ``class_size`` 1 is
  ``sort``; ``class_size`` = ``num_symbols`` accepts every permutation.
- ``arithmetic`` (for pretrained chat models): "What is a + b?" in natural text through the model's
  chat template; the answer is the last integer in the completion; reward 0/1.

Every task exposes ``sample(n, generator)`` (training problems, never from the held-out set),
``heldout`` (a fixed list), ``score(problem, response_ids) -> (reward, correct)``, ``eos_id``,
``pad_id``, ``max_new_tokens``; the token tasks also ``answer_ids(problem, generator)`` for the SFT warm start
(one right answer, drawn uniformly among them where there are several).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch

PAD, BOS, SEP, EOS = 0, 1, 2, 3
FIRST_SYMBOL = 4  # symbol s is token FIRST_SYMBOL + s; ids beyond the symbols stay unused (the tail)


@dataclass(frozen=True)
class Problem:
    prompt_ids: tuple[int, ...]
    target: Any  # tuple of symbol tokens (sequence tasks) or int (arithmetic)


def _until_eos(response: list[int], eos_id: int) -> list[int]:
    return response[: response.index(eos_id)] if eos_id in response else response


class Task:
    """Common part: held-out set and training sampling that avoids it."""

    name: str
    eos_id: int
    pad_id: int
    max_new_tokens: int

    def __init__(self, heldout_size: int, heldout_seed: int = 12345) -> None:
        g = torch.Generator().manual_seed(heldout_seed)
        seen: dict[tuple[int, ...], Problem] = {}
        while len(seen) < heldout_size:
            p = self._draw(g)
            seen.setdefault(p.prompt_ids, p)
        self.heldout: list[Problem] = list(seen.values())
        self._heldout_keys = set(seen)

    def _draw(self, g: torch.Generator) -> Problem:
        raise NotImplementedError

    def sample(self, n: int, generator: torch.Generator) -> list[Problem]:
        """n training problems (independent draws, never a held-out prompt)."""
        out: list[Problem] = []
        while len(out) < n:
            p = self._draw(generator)
            if p.prompt_ids not in self._heldout_keys:
                out.append(p)
        return out

    def score(self, problem: Problem, response: list[int]) -> tuple[float, bool]:
        raise NotImplementedError


class SequenceTask(Task):
    """copy / reverse / sort a sequence of ``length`` symbols out of ``num_symbols``."""

    KINDS = ("copy", "reverse", "sort")

    def __init__(
        self, kind: str, length: int = 6, num_symbols: int = 32, reward: str = "partial", heldout_size: int = 256
    ) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"task: unknown sequence task {kind!r}")
        if reward not in ("partial", "exact"):
            raise ValueError(f"reward: must be 'partial' or 'exact', got {reward!r}")
        if length < 1 or num_symbols < 2:
            raise ValueError("task_length must be >= 1 and num_symbols >= 2")
        if num_symbols**length < 4 * heldout_size:
            raise ValueError(f"task space {num_symbols}^{length} is too small for {heldout_size} held-out prompts")
        self.name, self.kind, self.length, self.num_symbols, self.reward = kind, kind, length, num_symbols, reward
        self.eos_id, self.pad_id = EOS, PAD
        self.max_new_tokens = length + 2  # room for one wrong extra token before EOS
        self.min_vocab = FIRST_SYMBOL + num_symbols
        self.prompt_len = length + 2
        super().__init__(heldout_size)

    def _draw(self, g: torch.Generator) -> Problem:
        xs = (torch.randint(0, self.num_symbols, (self.length,), generator=g) + FIRST_SYMBOL).tolist()
        ys = {"copy": xs, "reverse": xs[::-1], "sort": sorted(xs)}[self.kind]
        return Problem((BOS, *xs, SEP), tuple(ys))

    def answer_ids(self, problem: Problem, generator: torch.Generator | None = None) -> list[int]:
        """The ideal response (for the SFT warm start): target then EOS (one right answer, so no draw)."""
        return [*problem.target, EOS]

    def score(self, problem: Problem, response: list[int]) -> tuple[float, bool]:
        ans = _until_eos(response, EOS)
        target = problem.target
        correct = tuple(ans) == target and EOS in response
        if self.reward == "exact":
            return float(correct), correct
        hits = sum(a == t for a, t in zip(ans, target))
        return hits / max(len(target), len(ans)), correct

    def decode(self, ids: list[int]) -> str:
        names = {PAD: "<pad>", BOS: "<bos>", SEP: "|", EOS: "<eos>"}
        return " ".join(names.get(i, str(i - FIRST_SYMBOL)) for i in ids)


class ClassSortTask(SequenceTask):
    """Sort a sequence by class (symbol // ``class_size``), the symbols of one class in any order.

    ``target`` is the ascending sort, one of the right answers. Reward ``partial``: the share of positions whose
    symbol is in the class the target has there and is still unused among the prompt's symbols (so exactly the
    right answers score 1, and repeating or inventing a symbol scores like a wrong one); ``exact``: 0/1.
    """

    def __init__(
        self, length: int = 6, num_symbols: int = 32, class_size: int = 4, reward: str = "partial", heldout_size: int = 256
    ) -> None:
        if not 1 <= class_size <= num_symbols:
            raise ValueError(f"class_size: must be between 1 and num_symbols ({num_symbols}), got {class_size}")
        self.class_size = class_size
        super().__init__("sort", length, num_symbols, reward, heldout_size)
        self.name = "class_sort"

    def symbol_class(self, token: int) -> int:
        return (token - FIRST_SYMBOL) // self.class_size

    def answer_ids(self, problem: Problem, generator: torch.Generator | None = None) -> list[int]:
        """A right answer drawn uniformly: the target with each class's symbols shuffled, then EOS."""
        if generator is None:
            raise ValueError("generator: class_sort draws one of several right answers; pass a torch.Generator")
        order = torch.rand(self.length, generator=generator).tolist()
        return [t for _, _, t in sorted(zip(map(self.symbol_class, problem.target), order, problem.target))] + [EOS]

    def score(self, problem: Problem, response: list[int]) -> tuple[float, bool]:
        ans = _until_eos(response, EOS)
        unused = list(problem.target)
        hits = 0
        for a, t in zip(ans, problem.target):
            if a in unused and self.symbol_class(a) == self.symbol_class(t):
                unused.remove(a)
                hits += 1
        correct = hits == len(problem.target) == len(ans) and EOS in response
        if self.reward == "exact":
            return float(correct), correct
        return hits / max(len(problem.target), len(ans)), correct


class ArithmeticTask(Task):
    """Natural-text addition of two numbers in [0, max_operand] for a chat model; reward 0/1."""

    def __init__(self, tokenizer: Any, max_operand: int = 50, heldout_size: int = 64, max_new_tokens: int = 16) -> None:
        if tokenizer is None:
            raise ValueError("task 'arithmetic' needs a pretrained model with a tokenizer (e.g. --model smollm2-135m)")
        if (max_operand + 1) ** 2 < 4 * heldout_size:
            raise ValueError(f"max_operand {max_operand} is too small for {heldout_size} held-out prompts")
        self.name, self.tokenizer, self.max_operand = "arithmetic", tokenizer, max_operand
        self.eos_id = int(tokenizer.eos_token_id)
        self.pad_id = int(tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id)
        self.max_new_tokens = max_new_tokens
        super().__init__(heldout_size)

    def prompt_text(self, a: int, b: int) -> str:
        return f"What is {a} + {b}? Answer with just the number."

    def _draw(self, g: torch.Generator) -> Problem:
        a, b = torch.randint(0, self.max_operand + 1, (2,), generator=g).tolist()
        msgs = [{"role": "user", "content": self.prompt_text(a, b)}]
        if self.tokenizer.chat_template:
            text = self.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        else:
            text = msgs[0]["content"] + "\nAnswer:"
        ids = self.tokenizer(text, add_special_tokens=False).input_ids
        return Problem(tuple(ids), a + b)

    def score(self, problem: Problem, response: list[int]) -> tuple[float, bool]:
        text = self.tokenizer.decode(_until_eos(response, self.eos_id), skip_special_tokens=True)
        numbers = re.findall(r"-?\d+", text)
        correct = bool(numbers) and int(numbers[-1]) == problem.target
        return float(correct), correct

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)


TASK_NAMES = (*SequenceTask.KINDS, "class_sort", "arithmetic")


def build_task(name: str, tokenizer: Any = None, **kwargs: Any) -> Task:
    """Build a task by name; kwargs go to SequenceTask (length, num_symbols, reward), ClassSortTask (and
    class_size) or ArithmeticTask."""
    if name in SequenceTask.KINDS:
        return SequenceTask(name, **kwargs)
    if name == "class_sort":
        return ClassSortTask(**kwargs)
    if name == "arithmetic":
        return ArithmeticTask(tokenizer, **kwargs)
    raise ValueError(f"task: unknown task {name!r}; choose one of {', '.join(TASK_NAMES)}")
