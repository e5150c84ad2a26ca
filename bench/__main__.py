"""`python -m bench [--sections ...] [--quick]`: the evidence protocol of bench/evidence.py."""

from bench.evidence import main

main()
