"""Decision CPU on the product's whole default space (175,104 points: the family's landscapes, the later knobs without effect):
PYTHONPATH=. python reports/search/2026-12-08_s74_decision_cpu_default_space.py 3,17,42"""
import statistics
import sys
import time

import bench.family as family
from autotune.search.strategies.bayes.strategy import BayesStrategy
from autotune.space import load_space
from bench.search import family_search

family.family_space = lambda: load_space("default")  # Landscape reads it at each draw

rows = []
class Timed(BayesStrategy):
    def propose(self, state):
        t = time.process_time()
        try:
            return super().propose(state)
        finally:
            rows.append((len(state.history), time.process_time() - t))
for d in [int(x) for x in sys.argv[1].split(",")]:
    s = Timed()
    family_search(s, d, 4 * 3600.0, d)
    print("draw", d, "grid points", s._context.grid.size if s._context else None, file=sys.stderr)
by = {}
for n, s in rows:
    by.setdefault(min(n // 25 * 25, 150), []).append(s)
for k in sorted(by):
    v = sorted(by[k])
    print(f"probes {k:>3}-{k+24:<3} decisions {len(v):>4}  median {statistics.median(v):.3f} s  p90 {v[int(0.9*(len(v)-1))]:.3f} s  max {v[-1]:.3f} s")
