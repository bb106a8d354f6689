"""Training health checks: the PPO troubleshooting table as declared rules over the metric history.

- `base`: `Rule` (what a rule declares) and `History` (the metric rows it reads);
- `rules`: the built-in rules, registered under the entry-point group ``rlpipe.health``;
- `monitor`: the rules of a run (``health`` config section) and the live `Monitor`;
- `doctor`: the rules replayed over a run directory (``rlpipe doctor``, ``rlpipe report``).

A third-party rule is a dataclass subclassing `Rule`, registered in its package's
``[project.entry-points."rlpipe.health"]``; its fields, declared with `num`, are its parameters.
"""

from rlpipe.core.contracts.rule import History, Rule, halves, mean, slope
from rlpipe.core.observe.health.doctor import (Finding, doctor, examine, health_text, load_run,
                                      report_section)
from rlpipe.core.observe.health.monitor import Monitor, load_rules, monitor_for
from rlpipe.core.base.yamlconf import num

__all__ = ["Finding", "History", "Monitor", "Rule", "doctor", "examine", "halves", "health_text",
           "load_rules", "load_run", "mean", "monitor_for", "num", "report_section", "slope"]
