"""Parallel degrees, their validation, and the device mesh built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan.config.job_config import Parallelism

# Mesh dimension order, outermost first: pp talks least often, tp most.
MESH_DIM_ORDER = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


class ParallelismError(ValueError):
    """An impossible parallel layout; the message names the flag to change."""


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _etp_meaning(etp: int, tp: int) -> str:
    """What ``expert_tensor_parallel_degree`` ``etp`` does under ``tp``, for error lines."""
    if etp == 1:
        return "the TP ranks split the MoE tokens"
    if etp == tp:
        return "the TP ranks share their tokens and split each expert"
    return f"the TP ranks split the MoE tokens {tp // etp} ways and each expert {etp} ways"


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    cp: int
    tp: int
    pp: int
    ep: int
    etp: int
    world_size: int
    # not in the repr: checkpoints key their per-rank RNG states by repr(parallel_dims)
    cp_load_balance: bool = field(default=True, repr=False)
    """Head-tail load balancing of context parallel (sequence chunks of seq_len / (2 * cp))."""
    _meshes: dict[str, DeviceMesh] = field(default_factory=dict, repr=False)
    world_mesh: DeviceMesh | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def from_config(cls, cfg: Parallelism, world_size: int) -> ParallelDims:
        """Degrees from the ``[parallelism]`` section (dp_shard -1 takes the remaining ranks)."""
        return cls(
            dp_replicate=cfg.data_parallel_replicate_degree,
            dp_shard=cfg.data_parallel_shard_degree,
            cp=cfg.context_parallel_degree,
            tp=cfg.tensor_parallel_degree,
            pp=cfg.pipeline_parallel_degree,
            ep=cfg.expert_parallel_degree,
            etp=cfg.expert_tensor_parallel_degree,
            world_size=world_size,
            cp_load_balance=cfg.context_parallel_load_balancer == "headtail",
        )

    def _validate(self) -> None:
        flags = {
            "dp_replicate": "parallelism.data_parallel_replicate_degree",
            "cp": "parallelism.context_parallel_degree",
            "tp": "parallelism.tensor_parallel_degree",
            "pp": "parallelism.pipeline_parallel_degree",
            "ep": "parallelism.expert_parallel_degree",
            "etp": "parallelism.expert_tensor_parallel_degree",
        }
        for name, flag in flags.items():
            if getattr(self, name) < 1:
                raise ParallelismError(f"{flag}={getattr(self, name)} must be >= 1")
        if self.dp_shard == 0 or self.dp_shard < -1:
            raise ParallelismError(
                f"parallelism.data_parallel_shard_degree={self.dp_shard} must be -1 (use the "
                "remaining ranks) or >= 1"
            )
        others = self.dp_replicate * self.cp * self.tp * self.pp
        if self.dp_shard == -1:
            if self.world_size % others:
                raise ParallelismError(
                    f"world size {self.world_size} is not divisible by dp_replicate*cp*tp*pp = "
                    f"{self.dp_replicate}*{self.cp}*{self.tp}*{self.pp} = {others}, so "
                    "data_parallel_shard_degree=-1 cannot be resolved"
                )
            self.dp_shard = self.world_size // others
        product = others * self.dp_shard
        if product != self.world_size:
            raise ParallelismError(
                f"dp_replicate*dp_shard*cp*tp*pp = {self.dp_replicate}*{self.dp_shard}*{self.cp}*"
                f"{self.tp}*{self.pp} = {product} but the world size is {self.world_size} "
                "(NGPU / nproc_per_node x nodes); make the degrees multiply to the world size"
            )
        if self.etp > 1 and self.tp == 1:
            raise ParallelismError(
                f"parallelism.expert_tensor_parallel_degree={self.etp} needs tensor parallel (it "
                "splits each expert over TP ranks): set parallelism.tensor_parallel_degree to a "
                f"multiple of {self.etp}, or leave expert_tensor_parallel_degree at 1"
            )
        if self.tp % self.etp:
            fits = ", ".join(str(d) for d in _divisors(self.tp))
            raise ParallelismError(
                f"parallelism.expert_tensor_parallel_degree={self.etp} must divide "
                f"parallelism.tensor_parallel_degree={self.tp} (the TP ranks form tp/etp groups "
                "that route their own MoE tokens, each expert split over the etp ranks of a "
                f"group; 1 keeps experts whole): {fits} fit here"
            )
        if self.ep > 1:
            self._validate_ep()

    def _ep_fits(self, etp: int) -> list[int]:
        """The expert-parallel degrees that fit with ``etp``: multiples of the TP token groups
        (tp / etp) that divide the ranks with different MoE tokens (tp/etp x dp_shard x cp)."""
        groups = self.tp // etp
        return [groups * d for d in _divisors(self.dp_shard * self.cp) if groups * d > 1]

    def _validate_ep(self) -> None:
        """ep ranks are borrowed from the ranks that hold different MoE tokens within one
        replica (see build_mesh): dp_shard x cp, and the tp/etp token groups of the TP ranks.
        The line names the degrees that fit, and the other expert_tensor_parallel_degree
        values under which this ep would fit."""
        fits = self._ep_fits(self.etp)
        if self.ep in fits:
            return
        shard_cp = self.dp_shard * self.cp
        what = (
            f"data_parallel_shard_degree={self.dp_shard}" if self.cp == 1 else
            f"data_parallel_shard_degree*context_parallel_degree = {self.dp_shard}*{self.cp} "
            f"= {shard_cp}"
        )
        listed = (", ".join(map(str, fits)) + " fit" if len(fits) > 1 else
                  f"only {fits[0]} fits" if fits else "no degree fits")
        others = [e for e in _divisors(self.tp) if e != self.etp and self.ep in self._ep_fits(e)]
        other = ""
        if others:
            other = ("; or set expert_tensor_parallel_degree="
                     + " or ".join(map(str, others)) + " (" + "; ".join(
                         _etp_meaning(e, self.tp) for e in others) + ")")
        groups = self.tp // self.etp
        shard_all = self.dp_replicate * self.dp_shard  # replicas hold whole copies: ep never spans them
        if self.dp_replicate > 1 and self.ep in [
            groups * d for d in _divisors(shard_all * self.cp) if groups * d > 1
        ]:
            other += (f"; or shard instead of replicate (expert-parallel ranks never span "
                      f"replicas): data_parallel_replicate_degree=1, "
                      f"data_parallel_shard_degree={shard_all}")
        elif not fits and not others:
            other += "; or set it to 1 (no expert parallelism)"
        if groups == 1:
            raise ParallelismError(
                f"parallelism.expert_parallel_degree={self.ep} must divide {what} "
                "(expert-parallel ranks are borrowed from the ranks with different tokens"
                + (f"; with expert_tensor_parallel_degree={self.tp} the TP ranks share their "
                   "tokens and split each expert instead" if self.tp > 1 else "")
                + f"): {listed} here{other}"
            )
        how = ("the TP ranks split the MoE tokens and join one ep group" if self.etp == 1 else
               f"the TP ranks split the MoE tokens {groups} ways and the {groups} groups join "
               "one ep group")
        of = (f"tensor_parallel_degree={self.tp}" if self.etp == 1 else
              f"tensor_parallel_degree/expert_tensor_parallel_degree = {self.tp}/{self.etp} "
              f"= {groups}")
        raise ParallelismError(
            f"parallelism.expert_parallel_degree={self.ep} must be a multiple of {of} that "
            f"divides {groups} x {what} (with expert_tensor_parallel_degree={self.etp} {how}): "
            f"{listed} here{other}"
        )

    def validate_for_model(self, n_heads: int, n_kv_heads: int, n_layers: int, seq_len: int) -> None:
        """Checks that need the model shape and sequence length."""
        if self.tp > 1:
            if n_heads % self.tp:
                raise ParallelismError(
                    f"parallelism.tensor_parallel_degree={self.tp} must divide the model's "
                    f"n_heads={n_heads}"
                )
            if n_kv_heads % self.tp:
                raise ParallelismError(
                    f"parallelism.tensor_parallel_degree={self.tp} must divide the model's "
                    f"n_kv_heads={n_kv_heads} (grouped-query attention shards kv heads across "
                    "TP ranks); lower the TP degree"
                )
        if self.pp > n_layers:
            raise ParallelismError(
                f"parallelism.pipeline_parallel_degree={self.pp} exceeds the model's "
                f"n_layers={n_layers}"
            )
        balanced = self.cp > 1 and self.cp_load_balance
        seq_div = self.tp * self.cp * (2 if balanced else 1)
        if seq_len % seq_div:
            cp_part = (
                f", 2*cp={2 * self.cp} for context parallel load balancing)" if balanced
                else f", cp={self.cp} for context parallel)" if self.cp > 1 else ")"
            )
            raise ParallelismError(
                f"training.seq_len={seq_len} must be divisible by {seq_div} "
                f"(tp={self.tp} for sequence parallel" + cp_part
            )

    # --- which parallelisms are on -------------------------------------------------------
    @property
    def dp_enabled(self) -> bool:
        return self.dp_replicate * self.dp_shard > 1

    @property
    def dp_replicate_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def dp_shard_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard_enabled or self.cp_enabled

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def etp_enabled(self) -> bool:
        """Experts' hidden dimension split over ``etp`` TP ranks (expert tensor parallel)."""
        return self.etp > 1

    @property
    def moe_token_groups(self) -> int:
        """How many ways the TP ranks split the MoE tokens: ``tp / etp``. Each group of ``etp``
        TP ranks gathers its ranks' sequence shards, routes them and runs its ``1/etp`` of every
        expert; for the experts the groups are like data-parallel ranks (their router / expert
        gradients are summed over ``tp_tokens``, and ep may borrow them)."""
        return self.tp // self.etp

    @property
    def tp_splits_moe_tokens(self) -> bool:
        """Under TP with ``expert_tensor_parallel_degree`` < tp, MoE layers run on a part of the
        TP group's sequence (see :attr:`moe_token_groups`)."""
        return self.moe_token_groups > 1

    @property
    def loss_parallel_enabled(self) -> bool:
        return self.tp_enabled

    @property
    def dp_degree(self) -> int:
        """Number of distinct data shards (the dataloader splits across this many)."""
        return self.dp_replicate * self.dp_shard

    @property
    def non_data_parallel_size(self) -> int:
        return self.cp * self.tp * self.pp

    # --- mesh ------------------------------------------------------------------------------
    def build_mesh(self, device_type: str) -> DeviceMesh | None:
        """Create the world mesh of enabled dims plus flattened views dp, dp_shard_cp, dp_cp.

        Dims of size 1 are left out so no process group is created for them. With one rank
        there is no mesh at all (None).
        """
        if self.world_size == 1:
            return None
        degrees = {
            "pp": self.pp,
            "dp_replicate": self.dp_replicate,
            "dp_shard": self.dp_shard,
            "cp": self.cp,
            "tp": self.tp,
        }
        names = [n for n in MESH_DIM_ORDER if degrees[n] > 1]
        shape = [degrees[n] for n in names]
        mesh = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
        self.world_mesh = mesh
        self._meshes = {n: mesh[n] for n in names}
        flat = {
            "dp": ["dp_replicate", "dp_shard"],
            "dp_shard_cp": ["dp_shard", "cp"],
            "dp_cp": ["dp_replicate", "dp_shard", "cp"],
        }
        for flat_name, parts in flat.items():
            present = tuple(p for p in parts if p in names)
            if len(present) > 1:
                self._meshes[flat_name] = mesh[present]._flatten(mesh_dim_name=flat_name)
            elif len(present) == 1:
                self._meshes[flat_name] = mesh[present[0]]
        self._build_moe_meshes(mesh, names)
        return mesh

    def _build_moe_meshes(self, mesh: DeviceMesh, names: list[str]) -> None:
        """The meshes of the MoE layers, views of the world mesh.

        ``tp_tokens`` / ``etp``: the tp dim unflattened into (tp / etp, etp), etp innermost, so
        an etp group holds consecutive sequence shards (either is the whole tp dim when the
        other is 1). ``ep`` / ``dp_shard_mod_ep``: the ranks with different MoE tokens in one
        replica (dp_shard x cp x tp_tokens) flattened and unflattened into
        (dp_shard_mod_ep, ep), ep innermost: it takes the tp_tokens ranks first (they divide
        ep then), then cp, then dp_shard. Experts are Shard(0) over ep and FSDP-sharded over
        dp_shard_mod_ep (HSDP with dp_replicate); with expert TP their weights are DTensors
        on ``ep_etp``.
        """
        token_dim = None  # the world-mesh dim of the TP ranks' token groups
        if self.tp > 1 and self.etp not in (1, self.tp):
            mesh = mesh._unflatten(names.index("tp"), (self.moe_token_groups, self.etp),
                                   ("tp_tokens", "etp"))
            names, token_dim = [*names[:-1], "tp_tokens", "etp"], "tp_tokens"
            self._meshes.update(tp_tokens=mesh["tp_tokens"], etp=mesh["etp"])
        elif self.tp > 1 and self.etp == 1:
            token_dim = "tp"
            self._meshes["tp_tokens"] = self._meshes["tp"]
        elif self.tp > 1:
            self._meshes["etp"] = self._meshes["tp"]
        if self.ep > 1:
            source = self._meshes["dp_shard_cp"] if token_dim is None else None
            if source is None:
                present = tuple(d for d in ("dp_shard", "cp", token_dim) if d in names)
                source = (mesh[present]._flatten(mesh_dim_name="_".join(present))
                          if len(present) > 1 else mesh[present[0]])
            n = self.dp_shard * self.cp * self.moe_token_groups
            expert_mesh = source._unflatten(0, (n // self.ep, self.ep),
                                            ("dp_shard_mod_ep", "ep"))
            self._meshes["ep"] = expert_mesh["ep"]
            self._meshes["dp_shard_mod_ep"] = expert_mesh["dp_shard_mod_ep"]
        if self.etp > 1:
            parts = [self._meshes[n] for n in ("ep", "etp") if n in self._meshes]
            self._meshes["ep_etp"] = (
                DeviceMesh._concatenate(parts) if len(parts) > 1 else parts[0]
            )

    def get_mesh(self, name: str) -> DeviceMesh | None:
        """The (sub)mesh called ``name``, or None when that dimension is not in use."""
        return self._meshes.get(name)

    def mesh_local_rank(self, name: str) -> int:
        mesh = self.get_mesh(name)
        return 0 if mesh is None else mesh.get_local_rank()
