"""API keys and per-key limits (coordinator.gateway.auth), through the whole gateway
(coordinator.gateway.operator) and the official `openai` client where a client sees them."""

from __future__ import annotations

import hashlib

import httpx
import openai
import pytest
import trio
from hypothesis import given
from hypothesis import strategies as st

from coordinator.gateway.api import ApiConfig, serve_http
from coordinator.gateway.auth import Bucket, KeyBook, refilled, spent, wait_s
from coordinator.gateway.operator import create_gateway

HELLO = [{"role": "user", "content": "hello"}]
KEYS = "# operators' keys\nsk-alpha\n\n  sk-beta  \n"


@pytest.fixture
def key_file(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text(KEYS)
    return str(path)


def served(app, fn):
    """Run the real server on loopback for the duration of fn(base_url) (in a thread)."""

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            with trio.fail_after(30):
                result = await trio.to_thread.run_sync(fn, f"http://127.0.0.1:{port}")
            nursery.cancel_scope.cancel()
            return result

    return trio.run(main)


def client(base: str, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=20)


def test_key_file_keeps_digests_and_skips_comments_and_blanks(key_file):
    # Bug guarded: a comment or an indented key becoming (or hiding) a key, or the keys
    # kept in clear. Sound: the digests are exactly those of the two keys, in file order.
    book = KeyBook.from_file(key_file)
    assert book.digests == (hashlib.sha256(b"sk-alpha").digest(), hashlib.sha256(b"sk-beta").digest())
    assert book.match("sk-beta") == 1 and book.match("sk-alpha") == 0
    assert book.match("sk-alph") is None and book.match("") is None and book.match("# operators' keys") is None
    assert book.label(0) == "sha256:" + hashlib.sha256(b"sk-alpha").hexdigest()[:8]


def test_key_file_lines_may_be_digests(tmp_path):
    # Bug guarded: a file of digests (keys not kept at rest) read as literal keys. Sound:
    # the digest line admits the key it is the digest of, and only that key.
    path = tmp_path / "digests.txt"
    path.write_text("sha256:" + hashlib.sha256(b"sk-gamma").hexdigest() + "\nsha256:not-hex\n")
    book = KeyBook.from_file(str(path))
    assert book.match("sk-gamma") == 0 and book.match("sha256:not-hex") == 1 and book.match("sk-alpha") is None


def test_key_file_errors_name_the_file(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("# nothing yet\n\n")
    with pytest.raises(ValueError, match=r"^--api-keys .*empty.txt: no keys in the file \(one key per line\)$"):
        KeyBook.from_file(str(empty))
    with pytest.raises(ValueError, match=r"^--api-keys .*missing.txt: cannot read the key file \(FileNotFoundError"):
        KeyBook.from_file(str(tmp_path / "missing.txt"))


def test_the_flag_is_derived_from_api_config(key_file):
    # Bug guarded: a flag that exists in the CLI but not in the config (or the reverse).
    # Sound: the real parser turns --api-keys FILE into ApiConfig.api_keys, a KeyBook.
    from coordinator.cli import build_parser
    from coordinator.config import CoordConfig
    from shard.options import config_from_args

    args = build_parser().parse_args(["serve", "--api-keys", key_file, "--key-tokens-per-minute", "100",
                                      "--public-status", "--no-public-health"])
    config = config_from_args(CoordConfig, args).api
    assert config.api_keys == KeyBook.from_file(key_file) and config.key_tokens_per_minute == 100
    assert config.public_status and not config.public_health and not config.public_metrics


@given(tokens=st.floats(-1e6, 1e6), elapsed=st.floats(0, 1e4), rate=st.floats(0.01, 1e4), spend=st.integers(0, 10**6))
def test_bucket_refills_to_its_capacity_and_waits_exactly_until_positive(tokens, elapsed, rate, spend):
    # Bug guarded: a bucket that refills past a minute's worth (bursts) or a Retry-After
    # that is too short (the client is refused again). Sound: after waiting wait_s the
    # refilled bucket admits (tokens >= 0 up to float rounding), and never exceeds capacity.
    capacity = rate * 60
    b = refilled(spent(Bucket(min(tokens, capacity), 0.0), spend), elapsed, rate, capacity)
    assert b.tokens <= capacity and b.at_s == elapsed
    wait = wait_s(b, rate)
    assert wait >= 0 and (wait == 0) == (b.tokens >= 0)
    after = refilled(b, elapsed + wait, rate, capacity)
    assert after.tokens >= -1e-6 * max(1.0, abs(b.tokens))


def test_openai_client_without_or_with_a_wrong_key_gets_401(scripted, key_file):
    # Bug guarded: a gateway with keys that serves anyone, or refuses in a shape OpenAI
    # clients do not recognise. Sound: the official client raises AuthenticationError
    # (its mapping of 401) with OpenAI's error code; the right key gets its completion.
    engine = scripted([" one", " two"])
    app = create_gateway(engine, ApiConfig(api_keys=KeyBook.from_file(key_file)))

    def calls(base):
        out = {}
        try:
            client(base, "sk-wrong").chat.completions.create(model="scripted", messages=HELLO, max_tokens=2)
        except openai.AuthenticationError as exc:
            out["wrong"] = exc
        out["missing"] = httpx.post(f"{base}/v1/chat/completions", json={"model": "scripted", "messages": HELLO})
        out["ok"] = client(base, "sk-beta").chat.completions.create(model="scripted", messages=HELLO, max_tokens=8)
        out["health"] = httpx.get(f"{base}/health").status_code
        out["page"] = httpx.get(f"{base}/").status_code, httpx.get(f"{base}/static/status.js").status_code
        out["status"] = httpx.get(f"{base}/v1/status").status_code, httpx.get(f"{base}/v1/ring").status_code
        out["metrics"] = httpx.get(f"{base}/metrics").status_code
        out["status_key"] = httpx.get(f"{base}/v1/status", headers={"Authorization": "Bearer sk-alpha"}).status_code
        return out

    out = served(app, calls)
    wrong, missing = out["wrong"], out["missing"]
    assert wrong.status_code == 401 and wrong.body["code"] == "invalid_api_key"
    assert wrong.body["message"] == "Incorrect API key provided. Ask the operator of this gateway for a key."
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json()["error"]["message"].startswith("You didn't provide an API key.")
    assert out["ok"].choices[0].message.content == " one two"
    # Defaults: /health public, the page's files public, its data and /metrics need the key.
    assert out["health"] == 200 and out["page"] == (200, 200)
    assert out["status"] == (401, 401) and out["metrics"] == 401 and out["status_key"] == 200


def test_public_flags_open_the_status_data_and_metrics(scripted, key_file):
    engine = scripted([" one"])
    config = ApiConfig(api_keys=KeyBook.from_file(key_file), public_health=False, public_status=True,
                       public_metrics=True)
    app = create_gateway(engine, config)
    codes = served(app, lambda base: [httpx.get(base + p).status_code for p in
                                      ("/health", "/v1/status", "/v1/ring", "/metrics", "/v1/models")])
    assert codes == [401, 200, 200, 200, 401]


def test_per_key_concurrency_limit_is_429_with_retry_after(scripted, key_file):
    # Bug guarded: one key taking every generation slot. Sound: key alpha's first stream is
    # held open by the engine's gate, so its second request is concurrent for certain; key
    # beta is not affected; once the first ends, alpha is admitted again.
    engine = scripted([" one", " two", " three"])
    engine.gate = trio.Event()
    app = create_gateway(engine, ApiConfig(api_keys=KeyBook.from_file(key_file), key_max_concurrent_jobs=1))

    def calls(base, open_gate):
        alpha, beta = client(base, "sk-alpha"), client(base, "sk-beta")
        stream = alpha.chat.completions.create(model="scripted", messages=HELLO, max_tokens=20, stream=True)
        first = next(iter(stream))  # the job holds its slot now
        with pytest.raises(openai.RateLimitError) as refused:
            alpha.chat.completions.create(model="scripted", messages=HELLO, max_tokens=2)
        other = beta.chat.completions.create(model="scripted", messages=HELLO, max_tokens=4)
        open_gate()
        rest = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        again = alpha.chat.completions.create(model="scripted", messages=HELLO, max_tokens=4)
        return first, refused.value, other, rest, again

    async def main():
        async with trio.open_nursery() as nursery:
            port = await nursery.start(serve_http, app, "127.0.0.1", 0)
            trio_token = trio.lowlevel.current_trio_token()
            with trio.fail_after(30):
                result = await trio.to_thread.run_sync(
                    calls, f"http://127.0.0.1:{port}", lambda: trio.from_thread.run_sync(engine.gate.set, trio_token=trio_token))
            nursery.cancel_scope.cancel()
            return result

    first, refused, other, rest, again = trio.run(main)
    assert refused.status_code == 429 and refused.response.headers["retry-after"] == "1"
    assert refused.body["code"] == "rate_limit_exceeded" and refused.body["type"] == "requests"
    assert other.choices[0].message.content == " one" and again.choices[0].message.content == " one"
    assert rest == " one two three"


def test_per_key_token_rate_is_429_with_retry_after_until_refilled(scripted, key_file):
    # Bug guarded: a token budget that is never charged, or a Retry-After that does not
    # say how long. Sound: a 60-token-a-minute key (one a second) spends more than its
    # minute on one request (prompt + generated), so the next is refused with a wait of at
    # least the overdraft in seconds; the other key is unaffected.
    engine = scripted([" one two three four five six seven eight"], max_context_tokens=256)
    app = create_gateway(engine, ApiConfig(api_keys=KeyBook.from_file(key_file), key_tokens_per_minute=60))

    def calls(base):
        alpha, beta = client(base, "sk-alpha"), client(base, "sk-beta")
        first = alpha.completions.create(model="scripted", prompt="x" * 40, max_tokens=30)
        with pytest.raises(openai.RateLimitError) as refused:
            alpha.completions.create(model="scripted", prompt="x", max_tokens=1)
        other = beta.completions.create(model="scripted", prompt="x", max_tokens=1)
        return first, refused.value, other

    first, refused, other = served(app, calls)
    used = first.usage.prompt_tokens + first.usage.completion_tokens
    assert used > 60  # the request overdrew the bucket
    assert refused.status_code == 429 and refused.body["type"] == "tokens"
    assert int(refused.response.headers["retry-after"]) >= used - 60 - 1  # one token a second refills it
    assert other.choices[0].text


def test_the_banner_examples_send_the_key_when_keys_are_on():
    # Bug guarded: a gateway started with --api-keys printing examples that get 401 as
    # printed. Sound: both examples name $SHARD_API_KEY with keys on, and neither without.
    from coordinator.cli import banner

    on, off = banner(8000, "127.0.0.1", "m", keys=True), banner(8000, "127.0.0.1", "m")
    assert '-H "Authorization: Bearer $SHARD_API_KEY"' in on and "environ['SHARD_API_KEY']" in on
    assert "SHARD_API_KEY" not in off and "api_key='none'" in off
