"""Whether an address can be reached, and whether the swarm can reach us.

A peer that joins from another machine reaches its members on connections it opens itself, so it can
look healthy while nobody can open one to it (a wrong `--announce-host`, a closed firewall port, a NAT
that forwards nothing), and members that must open one cannot, without a word about why. So a joining peer
asks a member to dial it back (`warn_if_unreachable`): the member makes a plain TCP connection to each address
we announce and says what it found, and the peer warns before it trains.

A member dials an address only where it is the address our connection to it comes from, or a public
one: it is not made to probe the private network it sits in for a stranger. An announced private
address other than the one we come from is reported as such, untried.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
from typing import TYPE_CHECKING, Sequence

from hivemind.utils.multiaddr import Multiaddr

from decentral.swarm.wire import WireError, read_header, write_frame

if TYPE_CHECKING:
    from decentral.swarm.peer import SwarmPeer

log = logging.getLogger(__name__)

PLAIN_DIAL_TIMEOUT_S = 1.0  # a plain TCP dial that tells a live address from a dead one
REACH_STREAM = "reach"
MAX_ADDRESSES = 8  # announced addresses a member dials back for one request
REQUEST_TIMEOUT_S = 10.0  # a request's bytes, once its stream is open
ASK_TIMEOUT_S = 15.0  # the whole check, from the joining peer's side


def ip_and_port(maddr: str) -> tuple[str | None, str | None]:
    """The IP address and TCP port of a multiaddr, None for either it does not have (/dns4/..., /udp/...)."""
    found = {proto.name: value for proto, value in Multiaddr(str(maddr)).items()}
    return found.get("ip4", found.get("ip6")), found.get("tcp")


async def plain_dial(addresses: Sequence[tuple[str, str]]) -> str:
    """What a plain TCP connection to the (host, port)s of `addresses` finds: "accepted" when one accepts,
    "refused" when every one refuses (nothing listens there any more), "silent" when one does not answer
    within PLAIN_DIAL_TIMEOUT_S or there is none to try (which proves nothing)."""
    for host, port in addresses:
        try:
            async with asyncio.timeout(PLAIN_DIAL_TIMEOUT_S):
                _, writer = await asyncio.open_connection(host, int(port))
        except ConnectionRefusedError:
            continue
        except (OSError, TimeoutError):
            return "silent"
        writer.close()
        return "accepted"
    return "refused" if addresses else "silent"


def _requested(request: dict) -> list[tuple[str, int]]:
    """The (ip, port)s of a dial-back request; WireError when it is not a list of them."""
    addresses = request.get("addresses")
    if not isinstance(addresses, list) or len(addresses) > MAX_ADDRESSES:
        raise WireError(f"a dial-back request names no list of at most {MAX_ADDRESSES} addresses")
    out = []
    for item in addresses:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], int) and 0 < item[1] < 65536):
            raise WireError(f"a dial-back request's address {item!r} is no [ip, port]")
        try:
            out.append((str(ipaddress.ip_address(item[0])), item[1]))
        except ValueError:
            raise WireError(f"a dial-back request's address {item[0]!r} is no IP address") from None
    return out


def serve_reach_checks(peer: SwarmPeer) -> None:
    """Answer dial-back requests on `peer`: {"addresses": [[ip, port], ...]} → {"from": the ip the request's
    connection comes from, "found": [[ip, port, "accepted" | "refused" | "silent" | "untried"], ...]}."""

    async def on_request(sender: str, address: str, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        try:
            addresses = _requested(await asyncio.wait_for(read_header(reader, peer.stats, 2048), REQUEST_TIMEOUT_S))
        except (WireError, TimeoutError) as e:
            log.info("a malformed dial-back request from %s: %r", sender[-8:], e)
            return
        came_from, _ = ip_and_port(address)

        async def dial(ip: str, port: int) -> list:
            if ip != came_from and not ipaddress.ip_address(ip).is_global:
                return [ip, port, "untried"]
            return [ip, port, await plain_dial([(ip, str(port))])]

        found = await asyncio.gather(*(dial(ip, port) for ip, port in addresses))
        await write_frame(writer, json.dumps({"from": came_from, "found": found}).encode(), peer.stats)

    peer.add_handler(REACH_STREAM, on_request, with_address=True)


async def _ask(peer: SwarmPeer, member: str, addresses: list[tuple[str, int]]) -> dict:
    reader, writer = await peer.open_stream_or_again(member, REACH_STREAM)
    try:
        await write_frame(writer, json.dumps({"addresses": addresses}).encode(), peer.stats)
        answer = await read_header(reader, peer.stats, 4096)
    finally:
        writer.close()
    if not isinstance(answer.get("found"), list):
        raise WireError(f"a dial-back answer with no list of findings: {answer!r}")
    return answer


def reach_warning(peer: SwarmPeer, via: Sequence[str]) -> str | None:
    """What is wrong with how other machines reach `peer`, as a member we joined through (`via`: members'
    multiaddrs, asked in turn until one answers) finds when it dials our announced addresses back; None when
    it reached one, or when none of them could be asked (an older member, or none answering)."""
    ours = [(ip, int(port)) for ip, port in map(ip_and_port, peer.multiaddrs()) if ip and port][:MAX_ADDRESSES]
    for maddr in via:
        member = str(maddr).rsplit("/p2p/", 1)[-1]
        try:
            answer = peer.call(_ask(peer, member, ours)).result(timeout=ASK_TIMEOUT_S)
        except Exception as e:  # an older member serves no such stream; a dead or slow one proves nothing
            log.debug("dial-back check through %s: %r", member[-8:], e)
            continue
        found = [f for f in answer["found"] if isinstance(f, list) and len(f) == 3]
        if not found or any(verdict == "accepted" for _, _, verdict in found):
            return None
        failed = [(ip, port, verdict) for ip, port, verdict in found if verdict in ("refused", "silent")]
        if failed:
            ip, port, verdict = failed[0]
            why = "the connection was refused" if verdict == "refused" else "nothing answered"
            return (f"the member at {maddr} could not reach this peer at {ip}:{port} ({why}): members that must "
                    f"open a connection to it cannot. Open TCP port {port} to this machine (its firewall; forward it "
                    "on a NAT), or give --announce-host the address other machines reach it at, with --port")
        announced = ", ".join(sorted({ip for ip, _, _ in found}))
        return (f"the member at {maddr} sees this peer's connections come from {answer.get('from')}, but it "
                f"announces {announced} (a private address the member did not try): if other machines reach this "
                f"one at {answer.get('from')}, give --announce-host {answer.get('from')}; if they reach it at "
                f"{announced} on another network, ignore this")
    return None


def warn_if_unreachable(peer: SwarmPeer, via: Sequence[str]) -> None:
    """Log what `reach_warning` finds, as a warning (nothing to ask without `via`: a peer that starts a swarm)."""
    if via and (found := reach_warning(peer, via)):
        log.warning("%s", found)
