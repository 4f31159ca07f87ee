"""The planner's names for the price of a plan, which :mod:`fxpar.cost.estimate` computes (the planner
enumerates, prunes, searches and explains; it prices nothing itself)."""

from fxpar.cost.estimate import Estimate, Pricer, gb, price_plan

__all__ = ["Estimate", "Pricer", "gb", "price_plan"]
