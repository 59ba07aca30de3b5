"""Ray integration: ``tx.Tensor`` through Ray's object store (:mod:`exchange.ray.objects`),
a Ray Direct Transport for it (:mod:`exchange.ray.transport`), and ``tx.RayExecutor``,
a chain's stages on Ray actors (:mod:`exchange.ray.executor`), as one Ray Compiled Graph
with ``compiled=True`` (:mod:`exchange.ray.compiled`).

Ray is optional (``pip install "tensor-exchange[ray]"``): this package imports nothing,
Ray least of all; its modules import Ray when a function of theirs is called (the
transport's module when imported, since it subclasses Ray's classes). Inside it,
``import ray`` is the top-level Ray package (absolute imports), never this one.
"""
