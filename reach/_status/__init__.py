"""``reach status`` and ``reach top``: the fleet at a glance.

``model`` is pure (two samples in, one summary out); ``sample`` reads the routing table,
each agent's ``$SRV.STATS`` counters and the task census; ``render`` draws the summary as
text or JSON. The commands themselves are in ``reach._cli_status``.
"""

from .model import Sample, Summary, summarize
from .render import frame, to_json
from .sample import take

__all__ = ["Sample", "Summary", "frame", "summarize", "take", "to_json"]
