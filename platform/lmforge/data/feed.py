"""Streaming each rank's batches from the Parquet shards with Ray Data.

One `FeedReader` actor per job runs one Ray Data stream per epoch over the shards
in the epoch's block order (see `order.GlobalOrder`), keeps a window of samples,
and hands each DP rank (and that rank's TP and PP peers alike) whole chunks of
steps, so each sample is read once; a mixture's sources are read side by side
(`data.mixture`). The trainer (`BatchFeed`) keeps the next
chunk requested, so it only waits on an object reference: reading never
competes with the training loop for its interpreter. A distillation from the
offline teacher cache streams its shards, which mirror the dataset's, beside the
tokens in the same order: each sample's top-k targets travel with it. An instruction
dataset's samples carry their loss mask (and their teachers' top-k) in its own shards.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator, Optional

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import ray

from lmforge.data import storage
from lmforge.data.columns import TargetScorer, TopKTargets, sample_columns, scored_columns, target_columns
from lmforge.data.manifest import DatasetManifest, Manifest, MixtureManifest
from lmforge.data.mixture import ID_STRIDE, Mixture
from lmforge.data.order import BatchLayout, GlobalOrder
from lmforge.errors import UserError


def verified_shards(batch: pa.Table, digests: dict[str, str], columns: list[str]) -> pa.Table:
    """Each shard's bytes checked against its manifest sha256, then decoded: the file is
    read once, and a shard replaced or damaged since it was prepared never trains."""
    tables = []
    for path, data in zip(batch.column("path").to_pylist(), batch.column("bytes").to_pylist()):
        expected = digests.get(path.rsplit("/", 1)[-1])
        if expected and hashlib.sha256(data).hexdigest() != expected:
            raise UserError(
                f"data.path: shard {path} does not match its sha256 in manifest.json: it was replaced or damaged "
                "since it was prepared; prepare the dataset again"
            )
        tables.append(pq.read_table(pa.BufferReader(data), columns=columns))
    return pa.concat_tables(tables)


def _user_error_in(err: BaseException) -> Optional[UserError]:
    """The `UserError` behind Ray Data's wrappings of a task's error, if there is one (a
    task's error crosses processes as its traceback's text)."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, UserError):
            return UserError(str(err))
        for line in str(err).splitlines():
            if line.startswith(USER_ERROR_LINE):
                return UserError(line[len(USER_ERROR_LINE) :])
        err = getattr(err, "cause", None) or err.__cause__ or err.__context__
    return None


USER_ERROR_LINE = f"{UserError.__module__}.{UserError.__qualname__}: "


def decoder(columns: dict[str, tuple]):
    """(column names, a function from a batch to one tuple of values per sample)."""

    def decode(batch) -> list[tuple]:
        values = [batch.column(name).combine_chunks().flatten().to_numpy().reshape(-1, *shape) for name, shape in columns.items()]
        return list(zip(*values))

    return list(columns), decode


class EpochStream:
    """Samples of one epoch from `first_window` on, as Ray Data reads them, by window;
    `rows` names the columns read and decodes a batch into one value per sample."""

    def __init__(self, paths: list[str], order: GlobalOrder, rows, epoch: int, first_window: int, digests: dict[str, str]):
        """`digests`: shard file name -> sha256 (those the manifest records)."""
        self.order, self.epoch = order, epoch
        columns, self.decode = rows
        blocks = order.blocks(epoch)[first_window * order.window :]
        ctx = ray.data.DataContext.get_current()
        ctx.execution_options.preserve_order = True  # bounds what is held: files arrive in block order
        ctx.enable_progress_bars = False
        ctx.use_datasource_v2 = False  # V2 (Ray 2.60) delivers nothing until every file is read
        # Two read tasks per reader keep the stream ahead without starting dozens of
        # worker processes on a small machine. They reserve no CPU: when the ranks
        # hold every CPU of the cluster, reading must still go on, or training waits forever.
        # They run beside this reader where they can, so blocks need not cross nodes.
        here = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        # One block per shard: a block of several would carry the next window's shards along.
        # Read as bytes, hashed and decoded in the same task (fused): one read of each file.
        ds = ray.data.read_binary_files(
            [paths[b] for b in blocks],
            include_paths=True,
            num_cpus=0,
            concurrency=2,
            override_num_blocks=len(blocks),
            ray_remote_args={"scheduling_strategy": here},
        )
        ds = ds.map_batches(
            verified_shards,
            fn_kwargs={"digests": digests, "columns": ["sample_id", *columns]},
            batch_size=None,
            batch_format="pyarrow",
            num_cpus=0,
            compute=ray.data.TaskPoolStrategy(size=2),
            scheduling_strategy=here,
        )
        self._batches: Iterator = iter(ds.iter_batches(batch_format="pyarrow", batch_size=None, prefetch_batches=2))
        self.samples: dict[int, object] = {}
        self.shards_read: set[int] = set()  # a resume must not scan from the start: see test_feed

    def take_window(self, index: int) -> dict[int, object]:
        """Rows of window `index`, reading on until all of them have arrived."""
        wanted = self.order.window_ids(self.epoch, index).tolist()
        missing = set(wanted) - self.samples.keys()
        while missing:
            try:
                batch = next(self._batches, None)
            except Exception as err:  # noqa: BLE001 - Ray Data wraps a read task's error: a refused shard is told as itself
                raise (_user_error_in(err) or err) from None
            if batch is None:
                raise RuntimeError(f"shards ended before samples {sorted(missing)[:5]} of epoch {self.epoch} arrived")
            ids = batch.column("sample_id").to_numpy()
            self.shards_read.update((ids // self.order.block).tolist())  # a batch holds part of a shard, or several
            ids = ids.tolist()
            self.samples.update(zip(ids, self.decode(batch)))
            missing.difference_update(ids)
        return {i: self.samples[i] for i in wanted}

    def drop(self, ids) -> None:
        for i in ids:
            self.samples.pop(int(i), None)


class Source:
    """One set of shards read by window: the dataset's tokens (and what its samples carry
    beside them), or the teacher cache's targets."""

    def __init__(self, paths: list[str], order: GlobalOrder, rows, sizes: list[int], digests: Optional[dict[str, str]] = None):
        """`sizes`: each shard's bytes (0 where unknown); `digests`: file name -> sha256, where known."""
        self.paths, self.order, self.rows_of, self.sizes, self.digests = paths, order, rows, sizes, digests or {}
        self.stream: Optional[EpochStream] = None
        self.current: tuple[int, int] = (-1, -1)
        self.rows: dict[int, object] = {}
        self._shards_before = self._bytes_before = 0  # read by the streams replaced since

    @property
    def shards_read(self) -> int:
        return self._shards_before + (len(self.stream.shards_read) if self.stream else 0)

    @property
    def bytes_read(self) -> int:
        return self._bytes_before + (sum(self.sizes[i] for i in self.stream.shards_read) if self.stream else 0)

    def restart(self) -> None:
        """Drop the stream: the next row starts a new one at its window."""
        self._shards_before, self._bytes_before = self.shards_read, self.bytes_read
        self.stream, self.current, self.rows = None, (-1, -1), {}

    def row(self, position: int, sample: int):
        epoch, window = self.order.locate(position)
        if (epoch, window) != self.current:
            if self.stream is None or self.stream.epoch != epoch or window < self.current[1]:
                self._shards_before, self._bytes_before = self.shards_read, self.bytes_read
                self.stream = EpochStream(self.paths, self.order, self.rows_of, epoch, window, self.digests)
            self.stream.drop(self.rows)
            self.rows = self.stream.take_window(window)
            self.current = (epoch, window)
        return self.rows[sample]


@dataclass
class Dataset:
    """One prepared dataset a feed reads, in its own order."""

    path: str
    manifest: DatasetManifest
    order: GlobalOrder


def datasets_of(spec, manifest: Manifest) -> tuple[list[Dataset], Optional[Mixture]]:
    """The datasets a job reads (`data.path`, or each of a mixture's) and the mixture."""

    def order(m: DatasetManifest) -> GlobalOrder:
        return GlobalOrder(m.num_samples, spec.train.seed, block=m.shard_samples, window=spec.data.shuffle_window)

    if not isinstance(manifest, MixtureManifest):
        return [Dataset(spec.data.path, manifest, order(manifest))], None
    datasets = [Dataset(source.path, source.manifest, order(source.manifest)) for source in manifest.sources]
    return datasets, Mixture([source.weight for source in manifest.sources], spec.train.seed)


@ray.remote(num_cpus=0)
class FeedReader:
    """Reads the job's data once for the ranks it serves: each step's rows of the DP
    ranks `serves`, each slice handed to the `sharers` ranks that train on it (the TP
    and PP peers of one DP rank), then dropped. One reader for the whole job reads
    every sample once, whatever the layout."""

    def __init__(
        self,
        datasets: list[Dataset],
        mixture: Optional[Mixture],
        layout: BatchLayout,
        serves: list[int],
        sharers: int = 1,
        cache: Optional[TopKTargets] = None,
        scorer: Optional[TargetScorer] = None,
    ):
        """`cache`: top-k targets in shards named as the dataset's, read beside them (the
        dataset's own directory when its samples carry them); `scorer`: or made for each
        chunk as it is read (a served teacher), while the ranks train on the chunk before."""
        self.datasets, self.mixture, self.scorer = datasets, mixture, scorer
        self.sources = [self._sources(d, cache) for d in datasets]  # per dataset: its tokens, and a cache's targets
        self.layout, self.serves, self.sharers = layout, list(serves), sharers
        self._chunks: dict[tuple[int, int], list] = {}  # (first step, steps) -> per served rank: (ids, columns, takers left)

    def _sources(self, dataset: Dataset, cache: Optional[TopKTargets]) -> list[Source]:
        shards = dataset.manifest.shards
        files = [s.file for s in shards]
        sizes = [s.bytes or 0 for s in shards]
        own = cache is not None and storage.join(cache.directory) == storage.join(dataset.path)
        columns = sample_columns(dataset.manifest, cache.k if own else None)
        digests = {s.file: s.sha256 for s in shards if s.sha256}
        sources = [Source([storage.join(dataset.path, f) for f in files], dataset.order, decoder(columns), sizes, digests)]
        if cache is not None and not own:
            targets = target_columns(dataset.manifest.seq_len, cache.k)
            sources.append(Source([storage.join(cache.directory, f) for f in files], dataset.order, decoder(targets), [0] * len(files)))
            columns = {**columns, **targets}  # a new dict: the first source decodes its own columns
        self.columns = list(columns)
        return sources

    def relayout(self, layout: BatchLayout, serves: list[int], sharers: int) -> None:
        """Serve another attempt's layout (after a failure, or a resize): its ranks ask
        from their restored step on, and the streams are kept, so a resume within the
        windows held reads nothing again and starts no new Ray Data workers."""
        self.layout, self.serves, self.sharers = layout, list(serves), sharers
        self._chunks.clear()

    def shards_read(self) -> int:
        """Shards read so far, over all of this reader's sources."""
        return sum(source.shards_read for sources in self.sources for source in sources)

    def bytes_read(self) -> int:
        """Bytes of the dataset's shards read so far (a teacher cache's are not counted)."""
        return sum(source.bytes_read for sources in self.sources for source in sources)

    def _split(self, start: int, count: int):
        """(dataset, its first position, how many, the rows they fill) of global positions
        start..: the positions one dataset gets are consecutive in its own order."""
        if self.mixture is None:
            yield 0, start, count, np.arange(count)
            return
        which, positions = self.mixture.locate(start, count)
        for d in np.unique(which):
            rows = np.flatnonzero(which == d)
            yield int(d), int(positions[rows[0]]), len(rows), rows

    def prefetch(self, chunks: list[tuple[int, int]]) -> None:
        """Read the chunks (first step, steps) the ranks will ask for first, while they
        are still starting (loading torch takes seconds): their requests find them held.
        A read that fails here is left for those requests to meet and report."""
        for key in chunks:
            try:
                self._held(key)
            except Exception:  # noqa: BLE001 - the ranks' own requests read it again and fail with it
                return

    def chunks_held(self) -> int:
        """Chunks read and not yet taken by every rank they serve."""
        return len(self._chunks)

    def _held(self, key: tuple[int, int]) -> list:
        """Per served rank, [ids, columns, takers left] of chunk `key`, read on first ask."""
        if key not in self._chunks:
            try:
                self._chunks[key] = [[ids, columns, self.sharers] for ids, columns in self._read(*key)]
            except Exception:
                for source in (source for sources in self.sources for source in sources):
                    source.restart()  # a stream that failed (a read task lost with its node) is not asked again
                raise
        return self._chunks[key]

    def chunk(self, first_step: int, steps: int, dp_rank: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """(sample ids, {column: values}: tokens, and what the samples carry beside them)
        of DP rank `dp_rank` for `steps` steps, step-major. A mixture's ids are the
        source's index x `ID_STRIDE` + the sample's id in it."""
        key = (first_step, steps)
        served = self._held(key)[self.serves.index(dp_rank)]
        served[2] -= 1
        if all(taken[2] <= 0 for taken in self._chunks[key]):
            del self._chunks[key]  # every rank has its slice: never asked again
        return served[0], served[1]

    def _read(self, first_step: int, steps: int) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        """Each served rank's (ids, columns), read step by step in global order: the
        streams only move forward, so no shard is read twice."""
        ids, rows = {r: [] for r in self.serves}, {r: [] for r in self.serves}
        for step in range(first_step, first_step + steps):
            for rank in self.serves:
                step_ids, step_rows = np.empty(self.layout.per_rank, dtype=np.int64), [None] * self.layout.per_rank
                for d, first, count, slots in self._split(*self.layout.rank_positions(step, rank)):
                    order, sources = self.datasets[d].order, self.sources[d]
                    for slot, position, sample in zip(slots, range(first, first + count), order.ids(first, count)):
                        step_rows[slot] = [value for source in sources for value in source.row(position, int(sample))]
                        step_ids[slot] = int(sample) + (d * ID_STRIDE if self.mixture else 0)
                ids[rank].append(step_ids)
                rows[rank] += step_rows
        read = [(np.concatenate(ids[r]), {name: np.stack([row[i] for row in rows[r]]) for i, name in enumerate(self.columns)}) for r in self.serves]
        if self.scorer is not None:  # every served rank's rows in one go: the scorer fills its requests
            scored = scored_columns(self.scorer, np.concatenate([columns["tokens"] for _, columns in read]))
            for start, (_, columns) in zip(range(0, len(scored["topk_ids"]), self.layout.per_rank * steps), read):
                columns.update({name: values[start : start + self.layout.per_rank * steps] for name, values in scored.items()})
        return read


def start_reader(
    datasets: list[Dataset],
    mixture: Optional[Mixture],
    layout: BatchLayout,
    serves: list[int],
    sharers: int,
    cache: Optional[TopKTargets],
    node: str,
    scorer: Optional[TargetScorer] = None,
):
    """A `FeedReader` on `node`, strictly: a soft affinity lets Ray move it to a node it
    still counts as free, such as one that vanished moments ago and is not yet declared
    dead (seen after a node loss: the restarted rank failed again)."""
    affinity = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(node, soft=False)
    return FeedReader.options(scheduling_strategy=affinity).remote(datasets, mixture, layout, serves, sharers, cache, scorer)


AHEAD = 2  # chunks a feed keeps requested


def chunk_steps(first_step: int, prefetch_steps: int, end_step: Optional[int]) -> int:
    """How many steps a feed asks for at `first_step`: nothing past the last step trained."""
    return prefetch_steps if end_step is None else min(prefetch_steps, end_step - first_step)


def first_chunks(start_step: int, prefetch_steps: int, end_step: Optional[int]) -> list[tuple[int, int]]:
    """The (first step, steps) chunks a feed starting at `start_step` asks for first,
    exactly as `BatchFeed` does: what a reader may read before the ranks ask."""
    chunks, step = [], start_step
    for _ in range(AHEAD):
        steps = chunk_steps(step, prefetch_steps, end_step)
        if steps <= 0:
            break
        chunks.append((step, steps))
        step += steps
    return chunks


@dataclass
class FedStep:
    """One optimizer step's share of this rank."""

    step: int
    ids: np.ndarray  # sample ids, in the order of the rows
    tokens: np.ndarray  # [accum, micro, seq_len+1]
    waited: float  # seconds the trainer waited for it
    targets: Optional[tuple[np.ndarray, np.ndarray]] = None  # from the teacher cache: top-k ids, log-probs [accum, micro, seq_len, k]
    loss_mask: Optional[np.ndarray] = None  # an instruction dataset's: the next tokens learnt [accum, micro, seq_len]


class BatchFeed:
    """The trainer's side: yields each step's `FedStep` in turn, from the job's shared
    reader (`reader`), or else from a reader of its own."""

    def __init__(
        self,
        datasets: list[Dataset],
        mixture: Optional[Mixture],
        layout: BatchLayout,
        dp_rank: int,
        start_step: int,
        prefetch_steps: int,
        cache: Optional[TopKTargets] = None,
        reader=None,
        end_step: Optional[int] = None,
        scorer: Optional[TargetScorer] = None,
    ):
        """`end_step`: the last step trained; nothing past it is read ahead."""
        self.own_reader = reader is None
        if reader is None:
            reader = start_reader(datasets, mixture, layout, [dp_rank], 1, cache, ray.get_runtime_context().get_node_id(), scorer)
        self.reader, self.dp_rank, self.end_step = reader, dp_rank, end_step
        self.layout, self.prefetch_steps = layout, prefetch_steps
        self._next_step = self._next_request = start_step
        self._in_flight: deque = deque()
        self._buffer: deque = deque()
        for _ in range(AHEAD):
            self._request()

    def _request(self) -> None:
        steps = chunk_steps(self._next_request, self.prefetch_steps, self.end_step)
        if steps <= 0:
            return
        self._in_flight.append((self._next_request, steps, self.reader.chunk.remote(self._next_request, steps, self.dp_rank)))
        self._next_request += steps

    def _receive(self) -> float:
        first, steps, ref = self._in_flight.popleft()
        began = time.perf_counter()
        ids, columns = ray.get(ref)
        waited = time.perf_counter() - began
        self._request()
        per, shape = self.layout.per_rank, (self.layout.accum, self.layout.micro_batch)
        for i in range(steps):
            rows = slice(i * per, (i + 1) * per)
            step = {name: a[rows].reshape(*shape, *a.shape[1:]) for name, a in columns.items()}
            targets = (step["topk_ids"], step["topk_logprobs"]) if "topk_ids" in step else None
            self._buffer.append(FedStep(first + i, ids[rows], step["tokens"], 0.0, targets, step.get("loss_mask")))
        return waited

    def next(self) -> FedStep:
        waited = self._receive() if not self._buffer else 0.0
        fed = self._buffer.popleft()
        assert fed.step == self._next_step, f"feed out of order: got step {fed.step}, expected {self._next_step}"
        self._next_step += 1
        fed.waited = waited
        return fed

    def close(self) -> None:
        if self.own_reader:  # the job's shared reader is its controller's to stop
            ray.kill(self.reader)
