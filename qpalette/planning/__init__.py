"""`qpalette plan`: one palette entry per layer under memory and speed budgets (docs/method.md §5).

budget    budget strings (bits, bytes, tok/s, ms): a new budget kind goes here
inputs    the typed sensitivity and latency-profile documents the planner reads
program   the integer program (SCIP through OR-Tools), fusion groups of a memory-only plan, the bound
document  the typed plan document (`qpalette.plan/1`), its tables and plot
planner   loading and checking the inputs, solving, making the plan
"""
