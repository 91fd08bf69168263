"""Benchmarks of what h3engine ships, run from the repository root: `python -m benchmarks.NAME --help`.

Results go to benchmarks/results/ (one current file per benchmark and GPU); method, history and conclusions are in
benchmarks/NOTES.md. Tests may import these modules; nothing here imports from tests/.
"""
