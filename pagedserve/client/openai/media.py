"""http(s) `image_url`s fetched by the shim, and the request's image count (`limit_mm_per_prompt`).

A URL is fetched only from a host `--allowed-media-domains` lists (none by default). Its name is resolved once and
every address checked: a loopback, private, link-local or otherwise non-global address is refused unless that
address (or a network holding it) is itself listed, so a listed name that resolves inward is refused. The fetch
connects to the checked address (Host header and TLS name kept), so a second DNS answer cannot send it elsewhere;
redirects are not followed; the body is read up to `--media-max-bytes`, the whole fetch within
`--media-fetch-timeout`. Every refusal is a 400 naming the part's url."""

from __future__ import annotations

import asyncio
import base64
import ipaddress
import json
import socket
import weakref
from dataclasses import dataclass
from typing import Any

import httpx

from pagedserve.client.media_options import (
    DEFAULT_MEDIA_FETCH_TIMEOUT_S,
    DEFAULT_MEDIA_MAX_BYTES,
    MAX_IMAGES_PER_PROMPT,
)
from pagedserve.client.openai.errors import bad_request
from pagedserve.client.triton_client import TritonUnavailableError

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@dataclass(frozen=True)
class MediaSettings:
    """The shim's media flags (client/media_options.py)."""

    allowed_domains: tuple[str, ...] = ()
    fetch_timeout_s: float = DEFAULT_MEDIA_FETCH_TIMEOUT_S
    max_bytes: int = DEFAULT_MEDIA_MAX_BYTES
    image_limit: int | None = MAX_IMAGES_PER_PROMPT  # None: the llm model's limit_mm_per_prompt (image_limit_of)

    def allowed(self) -> tuple[frozenset[str], tuple[Network, ...]]:
        """The listed host names (lower case) and the listed addresses as networks."""
        names, networks = set(), []
        for entry in self.allowed_domains:
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                names.add(entry.lower().rstrip("."))
        return frozenset(names), tuple(networks)


_LLM_IMAGE_LIMITS: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()


async def image_limit_of(shim: Any) -> int:
    """The images a request may carry: --limit-mm-per-prompt's, else the llm model's limit_mm_per_prompt parameter
    read once (the llm's cap while it is unset, not JSON, or Triton cannot be asked)."""
    if shim.settings.media.image_limit is not None:
        return shim.settings.media.image_limit
    if shim not in _LLM_IMAGE_LIMITS:
        try:
            text = (await shim.client.model_parameters()).get("limit_mm_per_prompt", "").strip()
        except TritonUnavailableError:
            return MAX_IMAGES_PER_PROMPT
        try:
            limit = json.loads(text).get("image", MAX_IMAGES_PER_PROMPT) if text else MAX_IMAGES_PER_PROMPT
        except (json.JSONDecodeError, AttributeError):
            limit = MAX_IMAGES_PER_PROMPT  # the engine refuses such a value at load
        _LLM_IMAGE_LIMITS[shim] = min(limit, MAX_IMAGES_PER_PROMPT) if isinstance(limit, int) else MAX_IMAGES_PER_PROMPT
    return _LLM_IMAGE_LIMITS[shim]


async def resolve_images(images: list[str], params: list[str], settings: MediaSettings,
                         limit: int | None = None) -> list[str]:
    """The request's images as base64 files: data URL payloads as they are, http(s) URLs fetched (together).
    More images than the limit (`limit`, else the settings') are refused naming `messages` before anything is
    fetched."""
    limit = limit if limit is not None else settings.image_limit
    limit = MAX_IMAGES_PER_PROMPT if limit is None else limit
    if len(images) > limit:
        raise bad_request(f"at most {limit} image(s) may be provided in one prompt "
                          f"(limit_mm_per_prompt), got {len(images)}", "messages")
    fetches = {i: fetch_image(url, params[i], settings) for i, url in enumerate(images) if is_http_url(url)}
    if not fetches:
        return images
    fetched = dict(zip(fetches, await asyncio.gather(*fetches.values()), strict=True))
    return [fetched.get(i, image) for i, image in enumerate(images)]


def is_http_url(url: str) -> bool:
    """Whether an image_url is one the shim fetches (else a data: URL)."""
    return url[:8].lower().startswith(("http://", "https://"))


async def fetch_image(url: str, param: str, settings: MediaSettings) -> str:
    """The base64 file at an http(s) `url`, refused naming `param` unless allowed, small and prompt enough."""
    try:
        target = httpx.URL(url)
    except httpx.InvalidURL as error:
        raise bad_request(f"image_url.url is not a valid URL: {error}", param) from None
    if target.scheme not in ("http", "https") or not target.host:
        raise bad_request("image_url.url must be a data:image/...;base64, or http(s) URL with a host", param)
    if not settings.allowed_domains:
        raise bad_request("this server fetches no http(s) images (start it with --allowed-media-domains); "
                          "send a data:image/...;base64, URL", param)
    try:
        return await asyncio.wait_for(_fetch(target, param, settings), settings.fetch_timeout_s)
    except TimeoutError:
        raise bad_request(f"image_url.url did not arrive within {settings.fetch_timeout_s:g} s", param) from None
    except httpx.HTTPError as error:
        raise bad_request(f"image_url.url could not be fetched: {type(error).__name__}: {error}", param) from None


async def _fetch(target: httpx.URL, param: str, settings: MediaSettings) -> str:
    address = await _checked_address(target, param, settings)
    headers = {"Host": target.netloc.decode("ascii"), "Accept": "image/*"}
    pinned = target.copy_with(host=str(address))
    extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
    async with httpx.AsyncClient(timeout=settings.fetch_timeout_s, follow_redirects=False, trust_env=False) as client:
        async with client.stream("GET", pinned, headers=headers, extensions=extensions) as response:
            if response.status_code != 200:
                raise bad_request(f"fetching image_url.url answered HTTP {response.status_code} (redirects are "
                                  "not followed)", param)
            length = response.headers.get("content-length", "")
            if length.isdigit() and int(length) > settings.max_bytes:
                raise _too_large(settings, param)
            body = bytearray()
            async for chunk in response.aiter_bytes():
                body += chunk
                if len(body) > settings.max_bytes:
                    raise _too_large(settings, param)
    if not body:
        raise bad_request("image_url.url returned an empty body", param)
    return base64.b64encode(bytes(body)).decode("ascii")


def _too_large(settings: MediaSettings, param: str) -> Exception:
    return bad_request(f"image_url.url is over {settings.max_bytes} bytes (--media-max-bytes)", param)


async def _checked_address(target: httpx.URL, param: str, settings: MediaSettings) -> Address:
    """The first address of the URL's host, once every address it resolves to is allowed."""
    names, networks = settings.allowed()
    host = target.host.lower().rstrip(".")
    port = target.port or (443 if target.scheme == "https" else 80)
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as error:
        raise bad_request(f"image_url.url's host {host} cannot be resolved: {error}", param) from None
    addresses = [_plain(ipaddress.ip_address(info[4][0].split("%")[0])) for info in infos]
    for address in addresses:
        listed = any(address in network for network in networks if network.version == address.version)
        if not listed and host not in names:
            raise bad_request(f"image_url.url's host {host} is not in --allowed-media-domains", param)
        if not listed and not address.is_global:
            raise bad_request(f"image_url.url's host {host} is a loopback, private or reserved address "
                              f"({address}); allowed only when --allowed-media-domains lists it", param)
    return addresses[0]


def _plain(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it is."""
    mapped = getattr(address, "ipv4_mapped", None)
    return mapped if mapped is not None else address
