"""CPU per bayes decision (time.process_time around each propose), by probes so far: PYTHONPATH=. python reports/search/2026-11-28_decision_cpu.py"""
import statistics
import sys
import time

from autotune.search.strategies.bayes.strategy import BayesStrategy
from bench.search import family_search
from bench.trace import RANGE_SPAN


class Timed(BayesStrategy):
    def __init__(self):
        super().__init__()
        self.times = []
    def propose(self, state):
        start = time.process_time()
        out = super().propose(state)
        self.times.append((len(state.history), time.process_time() - start))
        return out

rows = []
for draw in (3, 17, 42):
    s = Timed()
    family_search(s, draw, 4 * 3600.0, draw % RANGE_SPAN)
    rows += s.times
    print(draw, len(s.times), "proposals", file=sys.stderr)
for lo, hi in ((0, 10), (10, 40), (40, 80), (80, 120), (120, 200), (200, 10**6)):
    t = sorted(x for n, x in rows if lo <= n < hi)
    if t:
        print(f"{lo}-{hi} probes: n={len(t)} median {1000*statistics.median(t):.0f} ms p95 {1000*t[int(0.95*(len(t)-1))]:.0f} ms max {1000*t[-1]:.0f} ms")
