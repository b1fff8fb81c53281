"""``furlong serve``: a rollout engine behind SGLang's native HTTP API (the subset RL uses and routers probe).

Modules: :mod:`.command` (flags, engine, server life), :mod:`.app` (routes),
:mod:`.schema` (request checks), :mod:`.responses` (``/generate`` answers),
:mod:`.generate`, :mod:`.control`, :mod:`.info` (endpoints), :mod:`.state`,
:mod:`.body`, :mod:`.disk_weights`. Shapes are SGLang 0.5.23's.
"""

from .command import serve

__all__ = ["serve"]
