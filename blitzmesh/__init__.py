"""Blitzmesh Python SDK: async and blocking clients of the gateway, typed errors, plain types.

Needs only grpcio and protobuf. The generated wire modules live in `blitzmesh.v1`; nothing in
the names exported here exposes a protobuf type.
"""

from blitzmesh._version import __version__
from blitzmesh.client import DEFAULT_TARGET, AsyncClient, Client, MessageLike
from blitzmesh.errors import (
    AuthenticationError,
    BlitzmeshError,
    DeadlineExceededError,
    InternalError,
    InvalidRequestError,
    NotFoundError,
    OverloadedError,
    RequestCancelledError,
    UnavailableError,
    UnimplementedError,
    from_rpc_error,
)
from blitzmesh.types import (
    ChatMessage,
    Choice,
    ClusterEvent,
    ClusterState,
    Completion,
    FinishReason,
    InstanceInfo,
    InstanceRole,
    InstanceState,
    LoadReport,
    ModelInfo,
    PolicyState,
    SamplingParams,
    ScaleResult,
    TokenChunk,
    TokenLogprob,
    TopLogprob,
    Usage,
)

__all__ = [
    "DEFAULT_TARGET",
    "AsyncClient",
    "AuthenticationError",
    "BlitzmeshError",
    "ChatMessage",
    "Choice",
    "Client",
    "ClusterEvent",
    "ClusterState",
    "Completion",
    "DeadlineExceededError",
    "FinishReason",
    "InstanceInfo",
    "InstanceRole",
    "InstanceState",
    "InternalError",
    "InvalidRequestError",
    "LoadReport",
    "MessageLike",
    "ModelInfo",
    "NotFoundError",
    "OverloadedError",
    "PolicyState",
    "RequestCancelledError",
    "SamplingParams",
    "ScaleResult",
    "TokenChunk",
    "TokenLogprob",
    "TopLogprob",
    "UnavailableError",
    "UnimplementedError",
    "Usage",
    "__version__",
    "from_rpc_error",
]
