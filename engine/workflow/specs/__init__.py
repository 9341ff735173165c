"""One module per workflow; each defines ``SPEC: WorkflowSpec``.

:mod:`engine.workflow.registry` discovers the modules here, so adding a
workflow is adding a module (and its stage executors), nothing else.
"""
