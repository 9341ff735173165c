"""Workflow specs (stage graphs) and the Workflow Message codec; torch-free."""

from engine.workflow.errors import InvalidRequest, InvalidTensor
from engine.workflow.registry import default_workflow, get_workflow, request_workflow, workflows
from engine.workflow.spec import StageSpec, TensorSpec, WorkflowSpec

__all__ = ["InvalidRequest", "InvalidTensor", "StageSpec", "TensorSpec", "WorkflowSpec", "default_workflow", "get_workflow",
           "request_workflow", "workflows"]
