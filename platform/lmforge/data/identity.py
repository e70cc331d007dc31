"""What decides a job's data order, kept in every checkpoint so a resume can tell
whether it would continue on the same order: the seed, the shuffle window, the
dataset's shard size, and the dataset itself (tokenizer, samples, shard contents).
"""

from __future__ import annotations

import hashlib

from lmforge.data.manifest import Manifest, MixtureManifest

# Each input, the job field a user changes to change it.
FIELDS = {
    "seed": "train.seed",
    "shuffle_window": "data.shuffle_window",
    "shard_samples": "data.shard_samples",
    "tokenizer_sha256": "data.path",
    "num_samples": "data.path",
    "shards_sha256": "data.path",
    "mixture_weights": "data.sources",
}


def order_inputs(spec, manifest: Manifest) -> dict:
    """For a mixture: its weights, and each source's inputs (listed in source order)."""
    one = not isinstance(manifest, MixtureManifest)
    parts = [source.manifest for source in manifest.sources] if isinstance(manifest, MixtureManifest) else [manifest]
    shards = "\n--\n".join("\n".join(shard.sha256 or "" for shard in part.shards) for part in parts)
    inputs = {
        "seed": spec.train.seed,
        "shuffle_window": spec.data.shuffle_window,
        "shard_samples": parts[0].shard_samples if one else [part.shard_samples for part in parts],
        "tokenizer_sha256": manifest.tokenizer.sha256,
        "num_samples": manifest.num_samples if one else [part.num_samples for part in parts],
        "shards_sha256": hashlib.sha256(shards.encode()).hexdigest(),
    }
    if isinstance(manifest, MixtureManifest):
        inputs["mixture_weights"] = [source.weight for source in manifest.sources]
    return inputs


def order_changes(saved: dict, now: dict) -> dict[str, list]:
    """{input: [saved, now]} for each input that differs. A checkpoint written before
    these were kept has none, and nothing is compared."""
    return {key: [saved.get(key), now.get(key)] for key in FIELDS if key in saved and saved.get(key) != now.get(key)}


def describe(key: str, saved, now) -> str:
    """One change, worded for the field a user would edit."""
    if FIELDS[key] == "data.path":
        return f"data.path: the dataset's {key} {now} differs from the {saved} the checkpoint was trained on"
    return f"{FIELDS[key]}: {now} differs from the {saved} the checkpoint was trained with"
