"""CPU per bayes decision (time.process_time around each propose), by probes so far, on design draws searched for 4 virtual hours:
PYTHONPATH=. python reports/search/2026-12-08_s74_decision_cpu.py 3,17,42,88,123,171
PYTHONPATH=. python reports/search/2026-12-08_s74_decision_cpu.py 3,17,42 --default-space
--default-space: over the product's whole default space (175,104 points), the family's landscapes with the later knobs without effect."""
import statistics
import sys
import time

import bench.family as family
from autotune.search.strategies.bayes.strategy import BayesStrategy
from autotune.space import load_space
from bench.search import family_search

if "--default-space" in sys.argv:
    family.family_space = lambda: load_space("default")  # Landscape reads it at each draw
draws = [int(d) for d in sys.argv[1].split(",")]
rows = []

class Timed(BayesStrategy):
    def propose(self, state):
        t = time.process_time()
        try:
            return super().propose(state)
        finally:
            rows.append((len(state.history), time.process_time() - t))

for d in draws:
    family_search(Timed(), d, 4 * 3600.0, d)
by = {}
for n, s in rows:
    by.setdefault(min(n // 25 * 25, 150), []).append(s)
for k in sorted(by):
    v = sorted(by[k])
    print(f"probes {k:>3}-{k+24:<3} decisions {len(v):>4}  median {statistics.median(v):.3f} s  p90 {v[int(0.9*(len(v)-1))]:.3f} s  max {v[-1]:.3f} s")
