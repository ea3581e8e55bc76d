"""Test scaffolding (fixtures, recorders) shared by pdmask's test trees and examples; production code never imports it."""
