"""Training health checks: the PPO troubleshooting table as declared rules over the metric history.

- `rlpipe.core.contracts.rule`: `Rule` (what a rule declares) and `History` (the metric rows it
  reads);
- `monitor`: the rules of a run (``health`` config section) and the live `Monitor`.

The built-in rules are plugins (`rlpipe.plugins.health.rules`), found like a third-party rule
through the entry-point group ``rlpipe.health``; ``rlpipe doctor`` replays them over a run
directory (`rlpipe.tools.doctor`). A third-party rule is a dataclass subclassing `Rule`,
registered in its package's ``[project.entry-points."rlpipe.health"]``; its fields, declared with
`num`, are its parameters.
"""

from rlpipe.core.contracts.rule import History, Rule, halves, mean, slope
from rlpipe.core.observe.health.monitor import Monitor, load_rules, monitor_for
from rlpipe.core.base.yamlconf import num

__all__ = ["History", "Monitor", "Rule", "halves", "load_rules", "mean", "monitor_for", "num",
           "slope"]
