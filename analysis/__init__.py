"""Run directories and logs -> scaling tables, plots, memory planner, communication cost model."""
