"""Global manager configuration."""

from __future__ import annotations

from pydantic import Field

from services.common.config import ServiceConfig


class GlobalManagerConfig(ServiceConfig):
    param_manager: str = Field("", description="parameter manager address (model catalogue, locations)")
    default_model: str = Field("", description="model kept at min_instances from the idle pool")
    min_instances: int = Field(0, ge=0, description="instances of default_model kept loaded")
    max_instances: int = Field(100, ge=1, description="upper bound for any scale-out")
    heartbeat_interval_s: float = Field(1.0, gt=0, description="period workers are told to heartbeat at")
    lost_after_s: float = Field(5.0, gt=0, description="an instance silent this long is LOST")
    window_s: float = Field(10.0, gt=0, description="load monitor window")
    tick_s: float = Field(0.5, gt=0, description="period of the control loop")
    load_timeout_s: float = Field(300.0, gt=0, description="a parameter load that takes longer fails")
    drain_timeout_s: float = Field(60.0, gt=0, description="in-flight requests get this long on scale-in")
    policy: str = Field("heteroscale", description="autoscaling policy name")
    policy_params: dict[str, str] = Field(default_factory=dict, description="policy parameters (JSON object)")
    autoscale: bool = Field(False, description="run the autoscaling policy in the control loop")
    advisory: bool = Field(False, description="decide and log, but do not act")
