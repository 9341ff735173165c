"""Dispatch policies every sender and every stage share: which instance of a stage a message goes to
(:mod:`engine.dispatch.deliver`) and which held request a stage serves next (:mod:`engine.dispatch.order`).

Decisions over what the caller holds (its routes, its unacknowledged counts, the requests it took), with no
I/O: the Proxy's injector and intake and the TaskWorker's loop, batcher and hand-off use them alike, so neither
imports the other for them.
"""
