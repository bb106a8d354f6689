"""Collectors, importable by name to compose in Python (``Pipeline(collector=...)``).
The same classes are rlpipe's built-in entry points; each is imported on first use.

>>> from rlpipe.plugins.collectors import HFCollector
>>> HFCollector.__module__
'rlpipe.plugins.collectors.hf'
"""

from rlpipe.plugins import lazy_exports

__all__, __getattr__ = lazy_exports(__name__, {
    "HFCollector": "hf:HFCollector",
    "VLLMCollector": "vllm:VLLMCollector",
    "Collector": "base:Collector",
})
