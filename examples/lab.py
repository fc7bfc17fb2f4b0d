"""The policy lab: compare policies on synthetic traces with a known optimum, no model runs.

    python examples/lab.py
"""

from spec_adapt import FixedLength

from spec_adapt.policies import GoodputModel, Nightjar
from spec_adapt.tools.lab import Static, compare, expected_goodput, synthetic_requests
from spec_adapt.policies.estimators import LatencyTable

# A verification pass that costs more with more tokens: T(B, s) = 1 + 0.1 s (1 + 0.15 (B - 1)).
table = LatencyTable(step={b: {s: 1 + 0.1 * s * (1 + 0.15 * (b - 1)) for s in range(17)} for b in (1, 4, 16)})
requests = synthetic_requests(200, 300, alpha=0.7, seed=0)
for batch in (1, 4, 16):
    theory = max(range(9), key=lambda g: expected_goodput(0.7, g, batch, table))
    out = compare({"nightjar": Nightjar(exploration="local"), "goodput": GoodputModel(explore=0.05),
                   "fixed4": FixedLength(4)}, requests, table, Static(batch))
    print(f"B={batch}: best fixed gamma {out['best_fixed_gamma']} (theory {theory}); " + ", ".join(
        f"{name} {100 * row['vs_best_fixed']:+.1f}%" for name, row in out["policies"].items()))
