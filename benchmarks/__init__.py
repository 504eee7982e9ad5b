"""GPU benchmarks, run as modules from the repository root: `python -m benchmarks.bench_quant`.

Each prints a table, writes JSON to benchmarks/results/ and times its torch anchor in the same
run; the shared timing, table and JSON helpers are in `benchmarks._common`.
"""
