"""A manifest's run, job and structure fingerprint (issue 25: whose checkpoint is this?).

Proves: the three keys round-trip in the flat and the two-level form and are left out when
unknown, so an old manifest (without them) reads as "unknown"; a hostile value (a 10 MB run,
a control character, a ``/``, a fingerprint that is not a sha256 digest) is an
``InvalidManifest`` naming the key, and, read from a tier, the manifest's key, the tier and
the checkpoint; a new manifest refuses them before it is written; the header budget the save
plan is checked against holds a manifest with the longest run, job, fingerprint and metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tierstore.errors import ConfigError, InvalidManifest
from tierstore.format import layout
from tierstore.format import manifest_format as fmt
from tierstore.format.manifest import FileEntry, Manifest, PartRef, _checksum
from tierstore.tiers.tier import Tier

ATTEMPT = "20261129T081814Z-3fa2b1c4"
FINGERPRINT = "sha256:" + "ab" * 32
GOLDEN = Path(__file__).parents[1] / "data" / "store-0.2"


def make(world: int = 2, part_ranks: int = fmt.PART_RANKS, **over: Any) -> Manifest:
    files = [FileEntry(".metadata", 900, 0xDEADBEEF, 0)] + [
        FileEntry(f"__{rank}_0.distcp", 1000 + rank, rank * 7, rank) for rank in range(world)
    ]
    fields: dict[str, Any] = dict(
        name="step-0000000010",
        step=10,
        attempt=ATTEMPT,
        world_size=world,
        created=1795940907.25,
        files=tuple(files),
        producer="tierstore test",
        encoding="raw",
        part_ranks=part_ranks,
        run="llama-7b ablation 3",
        job="slurm job 4242",
        fingerprint=FINGERPRINT,
    )
    fields.update(over)
    return Manifest(**fields)


def reseal(body: dict[str, Any]) -> bytes:
    """Re-sign a tampered body, so only the targeted validation can catch it."""
    body = {k: v for k, v in body.items() if k != "checksum"}
    return json.dumps({**body, "checksum": _checksum(body)}).encode()


class Parts:
    def __init__(self, manifest: Manifest) -> None:
        self.data = {ref.path: manifest.part_json(ref) for ref in manifest.parts}

    def __call__(self, name: str, attempt: str, ref: PartRef) -> tuple[str, bytes]:
        return f"{name}/{attempt}/{ref.path}", self.data[ref.path]


@pytest.mark.parametrize("world, part_ranks", [(2, fmt.PART_RANKS), (6, 2)], ids=["flat", "two-level"])
def test_run_job_and_fingerprint_round_trip_in_both_forms(world: int, part_ranks: int) -> None:
    built = make(world, part_ranks)
    assert built.version == (1 if part_ranks >= world else 2)
    body = json.loads(built.to_json())
    assert (body["run"], body["job"], body["fingerprint"]) == (
        "llama-7b ablation 3",
        "slurm job 4242",
        FINGERPRINT,
    )
    read = Manifest.from_json(built.to_json(), loader=Parts(built))
    assert read == built
    assert (read.run, read.job, read.fingerprint) == (built.run, built.job, built.fingerprint)
    assert read.files == built.files  # the parts are read and agree


@pytest.mark.parametrize("world, part_ranks", [(2, fmt.PART_RANKS), (6, 2)], ids=["flat", "two-level"])
def test_unknown_keys_are_left_out_and_read_as_none(world: int, part_ranks: int) -> None:
    built = make(world, part_ranks, run=None, job=None, fingerprint=None)
    body = json.loads(built.to_json())
    assert not {"run", "job", "fingerprint"} & set(body)
    read = Manifest.from_json(built.to_json(), loader=Parts(built))
    assert (read.run, read.job, read.fingerprint) == (None, None, None)


def test_a_manifest_written_before_runs_existed_has_none() -> None:
    for path in (GOLDEN / "manifests").glob("*.json"):
        read = Manifest.from_json(path.read_bytes())
        assert (read.run, read.job, read.fingerprint) == (None, None, None)
        assert read.to_json() == path.read_bytes()  # still written byte for byte as it was


HOSTILE = [
    ("run", "x" * (10 << 20), "run 'xxxx"),  # 10 MB: under the manifest's size limit
    ("run", "", "run ''"),
    ("run", "x" * (fmt.MAX_RUN + 1), "run 'xxx"),
    ("run", "a\nb", "run 'a\\\\nb'"),
    ("run", "a\x1b[2Jb", "run 'a\\\\x1b"),
    ("run", "../other", "run '../other'"),
    ("run", " padded", "run ' padded'"),
    ("run", 7, "run 7"),
    ("run", None, "run None"),
    ("job", ["slurm"], r"job \['slurm'\]"),
    ("job", "j\x00", "job 'j"),
    ("fingerprint", "sha256:" + "g" * 64, "fingerprint 'sha256:ggg"),
    ("fingerprint", "sha256:" + "AB" * 32, "fingerprint 'sha256:ABAB"),
    ("fingerprint", "ab" * 32, "fingerprint 'abab"),
    ("fingerprint", "sha256:" + "ab" * 33, "fingerprint 'sha256:abab"),
    ("fingerprint", 12, "fingerprint 12"),
]


@pytest.mark.parametrize("world, part_ranks", [(2, fmt.PART_RANKS), (6, 2)], ids=["flat", "two-level"])
@pytest.mark.parametrize(
    "key, value, named", HOSTILE, ids=[f"{k}-{i}" for i, (k, _, _) in enumerate(HOSTILE)]
)
def test_a_hostile_value_is_refused_naming_its_key(
    world: int, part_ranks: int, key: str, value: object, named: str
) -> None:
    body = json.loads(make(world, part_ranks).to_json())
    body[key] = value
    with pytest.raises(InvalidManifest, match=named) as info:
        Manifest.from_json(reseal(body), key="manifests/step-0000000010.json", tier="hot /h")
    assert len(str(info.value)) < 1000  # a 10 MB value is not echoed back


def test_a_hostile_manifest_in_a_tier_names_its_key_tier_and_checkpoint(tmp_path: Path) -> None:
    tier = Tier("hot", str(tmp_path))
    name = "step-0000000010"
    body = json.loads(make().to_json())
    body["run"] = "r" * (10 << 20)
    key = Path(tmp_path, layout.manifest_key(name))
    key.parent.mkdir(parents=True)
    key.write_bytes(reseal(body))
    with pytest.raises(InvalidManifest, match="run 'rrr") as info:
        tier.find_manifest(name)
    err = info.value
    assert (err.key, err.checkpoint) == (layout.manifest_key(name), name)
    assert err.tier == tier.label and str(tmp_path) in str(err)
    body["run"], body["fingerprint"] = "ok", "sha256:" + "z" * 64
    key.write_bytes(reseal(body))
    with pytest.raises(InvalidManifest, match="fingerprint 'sha256:zzz") as info:
        tier.find_manifest(name)
    assert (info.value.key, info.value.checkpoint, info.value.tier) == (
        layout.manifest_key(name),
        name,
        tier.label,
    )


@pytest.mark.parametrize(
    "over, named",
    [
        ({"run": "a/b"}, "run 'a/b' is not a run name"),
        ({"job": "\t"}, "job '\\\\t' is not a run name"),
        ({"run": "x" * 129}, "run 'xxx"),
        ({"fingerprint": "md5:00"}, "fingerprint 'md5:00'"),
    ],
)
def test_a_new_manifest_refuses_them_before_it_is_written(over: dict[str, Any], named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        make(**over)


def test_a_run_name_may_be_any_printable_text_up_to_the_limit() -> None:
    for run in ("B", "run 2026-12-01 #3", "实验-七", "😀" * fmt.MAX_RUN, "a:b=c@d"):
        assert Manifest.from_json(make(run=run).to_json()).run == run


@pytest.mark.parametrize("world, part_ranks", [(2, fmt.PART_RANKS), (3, 1)], ids=["flat", "two-level"])
def test_the_header_budget_holds_the_longest_run_job_fingerprint_and_metrics(
    world: int, part_ranks: int
) -> None:
    """check_plan bounds a manifest by _HEADER_BYTES plus its entries: the longest values of
    every optional header key (astral characters, 12 bytes each as JSON) stay inside it."""
    metrics = {f"m{i:0>63}": -1.2345678901234567e-300 for i in range(fmt.MAX_METRICS)}
    longest = "\U0001f600" * fmt.MAX_RUN  # printable, and 12 bytes as JSON
    built = make(world, part_ranks, run=longest, job=longest, metrics=metrics)
    bare = make(world, part_ranks, run=None, job=None, fingerprint=None)
    header = len(built.to_json()) - len(bare.to_json())
    assert header > 2 * 12 * fmt.MAX_RUN  # the escapes are there
    assert header + 4096 <= fmt._HEADER_BYTES  # what the plan's bound allows besides


def test_the_fingerprint_is_canonical() -> None:
    items = [("w", "float32", (3, 4)), ("step", None, None), ("opt.m", "bfloat16", (7,))]
    first = fmt.structure_fingerprint(items)
    assert first == fmt.structure_fingerprint(reversed(items))  # order of the keys does not count
    assert fmt._SHA256.fullmatch(first)
    assert first != fmt.structure_fingerprint([*items[:2], ("opt.m", "float32", (7,))])  # dtype
    assert first != fmt.structure_fingerprint([*items[:2], ("opt.m", "bfloat16", (8,))])  # shape
    assert first != fmt.structure_fingerprint([*items, ("extra", None, None)])  # a key
    assert first != fmt.structure_fingerprint([*items[:2], ("opt.m", None, None)])  # a kind
