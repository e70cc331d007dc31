"""The shape of a job's mesh, (pp, dp_replicate, dp_shard, tp), and each rank's
coordinates in it. No torch here: the controller and the planners use it too."""

from __future__ import annotations

from dataclasses import dataclass

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MeshShape:
    pp: int
    dp_replicate: int
    dp_shard: int
    tp: int

    @classmethod
    def for_layout(cls, pp: int, dp: int, tp: int, zero: int, replicate: int = 1) -> "MeshShape":
        if zero == 0:
            replicate = dp
        return cls(pp=pp, dp_replicate=replicate, dp_shard=dp // replicate, tp=tp)

    @classmethod
    def for_spec(cls, parallel) -> "MeshShape":
        p = parallel
        return cls.for_layout(p.pp, p.dp, p.tp, p.zero, p.dp_replicate)

    @property
    def dims(self) -> tuple[int, int, int, int]:
        return (self.pp, self.dp_replicate, self.dp_shard, self.tp)

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    def coordinates(self, rank: int) -> dict[str, int]:
        """(pp, dp, tp) of a global rank; tp varies fastest, so a TP group is
        consecutive ranks (and one placement bundle)."""
        pp, rest = divmod(rank, self.dp * self.tp)
        dp, tp = divmod(rest, self.tp)
        return {"pp": pp, "dp": dp, "tp": tp}
