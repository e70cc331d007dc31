"""The base of every job-file section: unknown keys are refused (a typo is an error,
not a silently ignored setting)."""

from pydantic import BaseModel, ConfigDict


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", protected_namespaces=())
