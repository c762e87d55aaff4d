"""``stageserve up`` with its default backends: every listening TCP socket of every process it
starts is bound to loopback, tensors move through owner-only files in /dev/shm that are gone
after the stop, and a greedy image chat answers what ``stageserve generate`` prints."""

from __future__ import annotations

import base64
import ipaddress
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path

import openai
import pytest

from services.transfer.shm_memory import NAME_RE, SHM_DIR
from tests.conftest import REPO, image_bytes
from tests.e2e.system import pid_alive, start_system

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
MAX_TOKENS = 16
TIMEOUT_S = 300  # generous bound on "no hang"
LOOPBACK = ipaddress.ip_address("127.0.0.1")


def descendants(pid: int) -> list[int]:
    """``pid``'s children, grandchildren, ... that run now."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat_text = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat_text.rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        found += children
        frontier = children
    return found


def _address(hex_address: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    raw = bytes.fromhex(
        hex_address
    )  # /proc/net/tcp{,6}: 32-bit words in host (little-endian) order
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return ipaddress.ip_address(words)


def listening_sockets(pid: int) -> list[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """(address, port) of each TCP socket in LISTEN state that ``pid`` holds open."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    found = []
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                hex_address, hex_port = local.split(":")
                found.append((_address(hex_address), int(hex_port, 16)))
    return found


def is_loopback_only(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped  # a dual-stack socket bound to ::ffff:127.0.0.1
    return address == LOOPBACK


def segments(owners: set[int]) -> dict[str, os.stat_result]:
    """The segments whose owner pid is in ``owners`` (other systems on this host have their own)."""
    entries = [
        e
        for e in os.scandir(SHM_DIR)
        if (m := NAME_RE.fullmatch(e.name)) and int(m.group(3)) in owners
    ]
    return {e.name: e.stat(follow_symlinks=False) for e in entries}


def test_default_system_listens_on_loopback_only_and_moves_tensors_through_shm(tmp_path):
    image = tmp_path / "image.png"
    image.write_bytes(image_bytes(300, 97, seed=11))
    system = start_system(tmp_path / "system", "--num-pages", "256")
    try:
        pids = descendants(system.process.pid)
        assert set(system.child_pids()) <= set(pids)
        sockets = {pid: listening_sockets(pid) for pid in pids}
        for name in ("tokenizer", "vision_encoder", "prefill", "decode", "router"):
            ports = {port for _, port in sockets[system.state[name]["pid"]]}
            assert int(system.state[name]["port"]) in ports, (
                name,
                sockets[system.state[name]["pid"]],
            )
        exposed = {
            pid: [s for s in found if not is_loopback_only(s[0])] for pid, found in sockets.items()
        }
        assert not any(exposed.values()), exposed
        assert _not_reachable_from_outside(sockets)

        created = segments(set(pids))
        assert sorted(NAME_RE.fullmatch(name).group(1) for name in created) == ["emb", "kv"]
        assert all(
            stat.S_IMODE(i.st_mode) == 0o600 and i.st_uid == os.geteuid() for i in created.values()
        )

        client = openai.OpenAI(
            base_url=system.base_url, api_key="unused", max_retries=0, timeout=TIMEOUT_S
        )
        model = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model,
            max_tokens=MAX_TOKENS,
            temperature=0,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _data_url(image.read_bytes())}},
                        {"type": "text", "text": "What is shown here?"},
                    ],
                }
            ],
        )
        generated = subprocess.run(
            [
                sys.executable,
                "-m",
                "services.cli",
                "generate",
                "--prompt",
                "What is shown here?",
                "--image",
                str(image),
                "--max-tokens",
                str(MAX_TOKENS),
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
            check=True,
        )
        assert reply.choices[0].message.content == generated.stdout.removesuffix("\n")
        assert reply.usage.completion_tokens > 0
    finally:
        code = system.stop()
    assert code == 0, system.logs()
    assert not [pid for pid in system.child_pids() if pid_alive(pid)]
    assert not segments(set(pids) | set(system.child_pids()))  # every owner unlinked its segment


def _not_reachable_from_outside(sockets) -> bool:
    """No listening port answers on a non-loopback address of this host (when it has one)."""
    outside = _non_loopback_address()
    if outside is None:
        return True
    for found in sockets.values():
        for _, port in found:
            with socket.socket() as probe:
                probe.settimeout(2)
                if probe.connect_ex((outside, port)) == 0:
                    return False
    return True


def _non_loopback_address() -> str | None:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: picks the outgoing interface, sends nothing
        except OSError:
            return None
        address = s.getsockname()[0]
    return None if ipaddress.ip_address(address).is_loopback else address


def _data_url(data: bytes) -> str:
    return f"data:image/png;base64,{base64.b64encode(data).decode()}"
