"""The configuration loader: embedded defaults, overrides, env, and one test per class of mistake."""

from __future__ import annotations

from pathlib import Path

import pytest

from hicache.config import (
    HicacheConfig,
    apply_override,
    build_config,
    default_config_text,
    load_config,
    parse_yaml,
    read_named_file,
)
from hicache.errors import ConfigError, FailedPrecondition
from hicache.types import ComponentKind, HostLayout, StorageBackendName, WritePolicy


def build(text: str) -> HicacheConfig:
    return build_config(parse_yaml(text))


def test_embedded_defaults_load_and_match_the_dataclass_defaults() -> None:
    cfg = load_config(env={})
    assert cfg.model.page_size == 64
    assert cfg.model.component_kinds == (ComponentKind.FULL,)
    assert cfg.storage.backend is StorageBackendName.NONE
    assert cfg.host_layout is HostLayout.LAYER_FIRST
    assert cfg == build_config({}), "hicache.yaml and the dataclass defaults drifted apart"


def test_embedded_text_is_the_repository_file() -> None:
    from pathlib import Path

    repo_file = Path(__file__).resolve().parents[1] / "hicache.yaml"
    assert default_config_text() == repo_file.read_text()


def test_hybrid_model_members_and_sizes() -> None:
    cfg = build(
        """
model:
  page_size: 16
  components:
    full: {layers: 2, bytes_per_token_per_layer: 8}
    swa: {layers: 2, bytes_per_token_per_layer: 8, window_tokens: 32}
    mamba: {layers: 2, state_bytes_per_layer: 100}
  sidecars:
    indexer: {anchor: full, layers: 2, bytes_per_token_per_layer: 1}
    conv: {anchor: mamba, layers: 2, state_bytes_per_layer: 10}
tiers: {l1: {tokens: 1600, mamba_slots: 7}, l2: {ratio: 3}}
storage: {backend: file}
"""
    )
    names = [m.name for m in cfg.model.members]
    assert names == ["full", "indexer", "swa", "mamba", "conv"]
    full = cfg.model.members[0]
    assert full.bytes_per_page_per_layer == 16 * 8
    assert cfg.model.members[1].anchor is ComponentKind.FULL
    assert cfg.model.members[3].bytes_per_page_per_layer == 100
    assert cfg.l1_pages == 100
    assert cfg.l2_pages(100) == 300
    assert cfg.pages_for(ComponentKind.MAMBA) == 7
    assert cfg.host_layout is HostLayout.PAGE_FIRST


def test_l2_size_gb_overrides_ratio() -> None:
    cfg = build("tiers: {l2: {size_gb: 1.0}}")
    per_page = sum(m.bytes_per_page for m in cfg.model.members)
    assert cfg.l2_pages(cfg.l1_pages) == (1 << 30) // per_page


@pytest.mark.parametrize(
    ("text", "fragment"),
    [
        # unknown key (names the path and the allowed keys)
        ("tiers: {l1: {tokenz: 5}}", "tiers.l1.tokenz: unknown key; allowed: ['device', 'mamba_slots', 'size_gb', 'tokens']"),
        ("bogus: 1", "bogus: unknown key"),
        # wrong type
        ("model: {page_size: '64'}", "model.page_size: expected an integer, got '64' (str)"),
        ("model: {page_size: true}", "model.page_size: expected an integer"),
        ("storage: {required: 1}", "storage.required: expected true or false"),
        ("tiers: [1, 2]", "tiers: expected a mapping, got [1, 2] (list)"),
        # ratio <= 1
        ("tiers: {l2: {ratio: 1}}", "tiers.l2.ratio: 1.0 must be > 1"),
        ("tiers: {l2: {ratio: 0.5}}", "tiers.l2.ratio: 0.5 must be > 1"),
        # sidecar naming an unknown anchor
        (
            "model: {sidecars: {idx: {anchor: swa, bytes_per_token_per_layer: 1}}}",
            "model.sidecars.idx.anchor: 'swa' is not a configured component; allowed: ['full']",
        ),
        ("model: {sidecars: {idx: {anchor: gpu}}}", "'gpu' (str) is not one of ['full', 'swa', 'mamba']"),
        # negative or zero sizes
        ("tiers: {l1: {tokens: -5}}", "tiers.l1.tokens: -5 must be > 0"),
        ("tiers: {l2: {size_gb: -1}}", "tiers.l2.size_gb: -1.0 must be > 0"),
        ("model: {page_size: 0}", "model.page_size: 0 must be > 0"),
        # unknown policy
        ("write: {l1_to_l2: write_sometimes}", "write.l1_to_l2: 'write_sometimes' (str) is not one of ['write_through', 'write_through_selective', 'write_back']"),
        ("prefetch: {policy: eager}", "prefetch.policy: 'eager' (str) is not one of ['best_effort', 'wait_complete', 'timeout']"),
        ("eviction: {policy: fifo}", "eviction.policy: 'fifo' (str) is not one of ['lru', 'lfu']"),
        ("write: {l1_to_l2_batch_pages: 0}", "write.l1_to_l2_batch_pages: 0 must be > 0"),
        # an L1 pool whose page ids would not fit the wire's int32
        ("model: {page_size: 1}\ntiers: {l1: {tokens: 2147483648}}",
         "tiers.l1 (tokens or size_gb): 2147483648 pages per L1 pool, over 2147483647 (page ids travel as int32)"),
        ("tiers: {l1: {mamba_slots: 2147483648}}",
         "tiers.l1.mamba_slots: 2147483648 pages per L1 pool, over 2147483647"),
        ("write: {l1_to_l2_batch_ms: -1}", "write.l1_to_l2_batch_ms: -1.0 must be in [0, 1000.0]"),
        ("write: {l1_to_l2_batch_ms: 5000}", "write.l1_to_l2_batch_ms: 5000.0 must be in [0, 1000.0]"),
        ("storage: {backend: s3}", "storage.backend: 's3' (str) is not one of ['none', 'file', 'mooncake', 'redis']"),
        # component rules
        ("model: {components: {swa: {bytes_per_token_per_layer: 4, window_tokens: 64}}}", "model.components: 'full' is required"),
        (
            "model: {components: {full: {bytes_per_token_per_layer: 4}, swa: {bytes_per_token_per_layer: 4, window_tokens: 100}}}",
            "model.components.swa.window_tokens: 100 is not a multiple of model.page_size (64)",
        ),
        ("model: {components: {full: {bytes_per_token_per_layer: 4, window_tokens: 64}}}", "model.components.full.window_tokens: not used by a full component"),
        ("model: {components: {full: {bytes_per_token_per_layer: 4}, mamba: {layers: 2}}}", "model.components.mamba.state_bytes_per_layer: 0 must be > 0"),
        ("model: {components: {full: {bytes_per_token_per_layer: 4}, lstm: {layers: 2}}}", "'lstm' (str) is not one of"),
        ("model: {sidecars: {full: {anchor: full, bytes_per_token_per_layer: 1}}}", "model.sidecars.full: a sidecar may not take a component's name"),
        # cross-section rules and server
        ("prefetch: {threshold_tokens: 16}", "prefetch.threshold_tokens: 16 is below one page"),
        ("server: {listen: 'localhost'}", "server.listen: 'localhost' is neither unix:///path nor host:port"),
        ("server: {socket_mode: 'rw'}", "server.socket_mode: 'rw' is not an octal mode"),
        ("server: {tls_cert: /a.pem}", "server.tls_cert/tls_key: give both or neither"),
        ("server: {tokens: [{token: short, namespaces: [a]}]}", "server.tokens[0].token: must be at least 16 characters"),
        ("storage: {backend: mooncake}", "storage.mooncake.master: required with storage.backend=mooncake (or set MOONCAKE_MASTER)"),
        ("storage: {redis: {url: 'http://x'}}", "storage.redis.url: must start with redis://, rediss:// or unix:// (got scheme http)"),
        # (the URL itself is not shown: it may hold a password)
        ("storage: {redis: {url: 'http://u:secretpw@x'}}", "(got scheme http)"),
        ("storage: {redis: {ttl_s: 4294967296}}", "storage.redis.ttl_s: 4294967296 is over 2147483647"),
        ("storage: {file: {threads: 0}}", "storage.file.threads: 0 must be in [1, 64] (or null: by filesystem)"),
        ("storage: {file: {threads: 65}}", "storage.file.threads: 65 must be in [1, 64]"),
        ("storage: {file: {threads: auto}}", "storage.file.threads: expected an integer"),
        ("metrics: {port: 70000}", "metrics.port: 70000 must be in [0, 65535]"),
        ("server: {listen: 'unix://relative.sock'}", "server.listen: 'unix://relative.sock': a unix socket address is unix:///absolute/path"),
        # numbers that are not finite, or beyond what the wire can carry
        ("tiers: {l1: {size_gb: .nan}}", "tiers.l1.size_gb: nan is not a finite number"),
        ("tiers: {l2: {ratio: .inf}}", "tiers.l2.ratio: inf is not a finite number"),
        ("storage: {timeout_s: .nan}", "storage.timeout_s: nan is not a finite number"),
        ("server: {shutdown_flush_s: -.inf}", "server.shutdown_flush_s: -inf is not a finite number"),
        ("server: {lease_ms: 5000000000}", "server.lease_ms: 5000000000 is over 4294967295"),
        ("server: {max_tokens_per_request: 1000000000}", "server.max_tokens_per_request: 1000000000 is over 268435456"),
        # keys that are not strings
        ("tiers: {1: 2, x: 3}", "tiers.1: unknown key"),
    ],
)
def test_each_mistake_names_key_value_and_allowed(text: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        build(text)
    assert fragment in str(err.value)


def test_a_redis_url_with_a_bad_scheme_is_refused_without_showing_it() -> None:
    """The URL may hold a password (`user:password@`): a configuration error goes to
    stderr, which systemd sends to the journal."""
    with pytest.raises(ConfigError) as err:
        build("storage: {redis: {url: 'http://u:secretpw@x'}}")
    assert "storage.redis.url" in str(err.value) and "secretpw" not in str(err.value)


def test_not_yaml_and_not_a_mapping(tmp_path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, env={})
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="cannot read configuration file"):
        load_config(tmp_path / "missing.yaml", env={})


def test_dotted_overrides_are_typed_and_validated() -> None:
    cfg = load_config(overrides=["storage.backend=redis", "tiers.l2.ratio=4", "write.l1_to_l2=write_back"], env={})
    assert cfg.storage.backend is StorageBackendName.REDIS
    assert cfg.tiers.l2.ratio == 4.0
    assert cfg.write.l1_to_l2 is WritePolicy.WRITE_BACK
    with pytest.raises(ConfigError, match=r"tiers\.l2\.ratio: 0\.5 must be > 1"):
        load_config(overrides=["tiers.l2.ratio=0.5"], env={})
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_override({}, "storage.backend")
    with pytest.raises(ConfigError, match=r"model\.page_size is not a section"):
        apply_override({"model": {"page_size": 4}}, "model.page_size.x=1")


def test_mooncake_environment_fills_missing_keys_and_yaml_wins() -> None:
    env = {
        "MOONCAKE_MASTER": "10.0.0.1:50051",
        "MOONCAKE_TE_META_DATA_SERVER": "http://10.0.0.1:8080/metadata",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "33554432",
    }
    cfg = load_config(overrides=["storage.backend=mooncake", "storage.mooncake.master=h:1"], env=env)
    assert cfg.storage.mooncake.master == "h:1"
    assert cfg.storage.mooncake.metadata_server == "http://10.0.0.1:8080/metadata"
    assert cfg.storage.mooncake.global_segment_size == 33554432
    with pytest.raises(ConfigError, match="MOONCAKE_GLOBAL_SEGMENT_SIZE: 'lots' is not an integer"):
        load_config(env={"MOONCAKE_GLOBAL_SEGMENT_SIZE": "lots"})
    # Mooncake mounts no segment under 16 MiB (its setup fails with a bare -600)
    with pytest.raises(ConfigError, match="global_segment_size: 8388608 bytes is under the 16777216"):
        load_config(env={**env, "MOONCAKE_GLOBAL_SEGMENT_SIZE": str(8 << 20)})


def test_config_is_frozen() -> None:
    cfg = load_config(env={})
    with pytest.raises(AttributeError):
        cfg.model.page_size = 1  # type: ignore[misc]


def test_prefetch_timeout_formula() -> None:
    p = load_config(env={}).prefetch
    assert p.timeout_for(0) == 2.0
    assert p.timeout_for(10240) == pytest.approx(3.0)
    assert p.timeout_for(10_000_000) == 30.0


@pytest.mark.parametrize("name", ["a/b", "", "индекс", "x" * 33])
def test_a_sidecar_name_must_fit_segment_names_and_keys(name: str) -> None:
    raw = {"model": {"sidecars": {name: {"anchor": "full", "layers": 1, "bytes_per_token_per_layer": 2}}}}
    with pytest.raises(ConfigError, match=r"model\.sidecars: name .* must be 1-32 ASCII"):
        build_config(raw)


def test_mooncake_environment_fills_an_empty_storage_section() -> None:
    from hicache.config import apply_env

    for raw in ({"storage": None}, {"storage": {"backend": "mooncake", "mooncake": None}}):
        apply_env(raw, {"MOONCAKE_MASTER": "10.0.0.1:50051"})
        assert raw["storage"]["mooncake"]["master"] == "10.0.0.1:50051"
    with pytest.raises(ConfigError, match="storage: expected a mapping"):
        apply_env({"storage": 5}, {"MOONCAKE_MASTER": "10.0.0.1:50051"})


def test_a_token_listed_twice_or_with_spaces_is_refused() -> None:
    twice = {"server": {"tokens": [{"token": "t" * 20, "namespaces": ["a"]},
                                   {"token": "t" * 20, "namespaces": ["*"]}]}}
    with pytest.raises(ConfigError, match=r"server\.tokens\[1\]\.token: the same token is listed twice"):
        build_config(twice)
    spaced = {"server": {"tokens": [{"token": " " + "t" * 20, "namespaces": ["a"]}]}}
    with pytest.raises(ConfigError, match="printable ASCII without surrounding spaces"):
        build_config(spaced)


SECRET = "s3cr3t-token-value-12345"


@pytest.mark.parametrize("text", [
    f"server:\n  tokens:\n    - {SECRET}\n",  # a list of strings, not of mappings
    f"server:\n  tokens: {SECRET}\n",
    "server:\n  tokens:\n    - token: 123456789012345678901234\n      namespaces: [a]\n",
    f"server:\n  tokens:\n    - {SECRET}: [a]\n",  # the token as a key
    f'server:\n  tokens:\n    - token: "{SECRET}\n      namespaces: [a]\n',  # not YAML
    f"server:\n  tokens:\n    - token: {SECRET}\n\tnamespaces: [a]\n",  # a tab: not YAML
])
def test_a_configuration_error_never_shows_a_token(text: str) -> None:
    """Errors go to stderr (the journal, under systemd): a token's value, or a line of the
    file that may hold one, is never part of the message; where it is, is."""
    with pytest.raises(ConfigError) as info:
        build(text)
    message = str(info.value)
    assert SECRET not in message and "123456789012345678901234" not in message, message
    assert "server.tokens" in message or "line " in message, message


def test_a_set_override_of_the_tokens_hides_its_value() -> None:
    from hicache.config import apply_override

    with pytest.raises(ConfigError) as info:
        apply_override({}, f"server.tokens=[{{token: '{SECRET}]")
    assert SECRET not in str(info.value) and "server.tokens" in str(info.value)
    with pytest.raises(ConfigError, match=r"storage.backend: value '\[oops' is not valid YAML"):
        apply_override({}, "storage.backend=[oops")  # other values are shown


def test_a_key_given_twice_is_refused_not_silently_dropped() -> None:
    with pytest.raises(ConfigError, match="duplicate key 'storage'"):
        build("storage: {backend: file}\nstorage: {backend: none}\n")


def test_a_file_that_is_not_utf8_is_a_configuration_error(tmp_path) -> None:
    from hicache.config import load_config

    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("model: {id: caf\xe9}\n".encode("latin-1"))
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(str(bad), [], env={})


@pytest.mark.parametrize("listen", ["http://127.0.0.1:50194", "host/x:80", "a b:1"])
def test_a_listen_address_with_a_scheme_or_path_is_refused(listen: str) -> None:
    with pytest.raises(ConfigError, match=r"server\.listen"):
        build_config({"server": {"listen": listen}})


def test_layer_first_with_an_l3_backend_is_refused_by_the_loader() -> None:
    with pytest.raises(ConfigError, match="layer_first cannot serve an L3 backend"):
        build_config({"tiers": {"l2": {"layout": "layer_first"}}, "storage": {"backend": "file"}})


def test_an_l2_size_not_larger_than_l1_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"tiers\.l2\.size_gb: .* L2 must hold L1 and more"):
        build_config({"tiers": {"l2": {"size_gb": 0.0001}}})


def test_a_sidecar_size_its_anchor_does_not_use_is_refused() -> None:
    raw = {"model": {"sidecars": {"ix": {"anchor": "full", "layers": 1, "bytes_per_token_per_layer": 2,
                                         "state_bytes_per_layer": 8}}}}
    with pytest.raises(ConfigError, match=r"ix\.state_bytes_per_layer: not used by a full-anchored sidecar"):
        build_config(raw)


def test_an_unquoted_socket_mode_gets_a_quoting_hint() -> None:
    with pytest.raises(ConfigError, match="quote it"):
        build("server: {socket_mode: 0660}\n")


def test_yaml_merge_keys_still_work_and_an_unhashable_key_is_a_configuration_error() -> None:
    text = (
        "model:\n"
        "  sidecars:\n"
        "    indexer: {<<: &geom {layers: 2, bytes_per_token_per_layer: 8}, anchor: full}\n"
    )
    assert build(text).model.sidecars["indexer"].layers == 2
    with pytest.raises(ConfigError, match="unhashable key"):
        build("? {a: 1}\n: 2\n")


def test_a_merged_then_aliased_mapping_is_accepted_and_a_merged_duplicate_refused() -> None:
    import yaml

    text = (
        "model:\n"
        "  sidecars:\n"
        "    indexer: {<<: &side {<<: &base {anchor: full, layers: 2, bytes_per_token_per_layer: 8},"
        " bytes_per_token_per_layer: 2}, layers: 1}\n"
        "    scale: *side\n"
    )
    assert parse_yaml(text) == yaml.safe_load(text)
    assert build(text).model.sidecars["scale"].bytes_per_token_per_layer == 2
    with pytest.raises(ConfigError, match="duplicate key"):
        parse_yaml("model: {<<: {page_size: 4, page_size: 8}}\n")


def test_a_yaml_value_key_is_read_like_plain_yaml() -> None:
    import yaml

    assert parse_yaml("a: {=: 1}\n") == yaml.safe_load("a: {=: 1}\n")


@pytest.mark.parametrize("text", ["a: {=: 1, =: 2}\n", "a: {=: 1, '=': 2}\n"])
def test_a_duplicated_value_key_is_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="duplicate key"):
        parse_yaml(text)


def test_a_reply_that_could_not_fit_in_a_grpc_message_is_a_configuration_error() -> None:
    """At page size 1 a reply lists 8 bytes a token for every member: limits under which
    a valid request would need a reply over gRPC's 2 GiB are refused at start, naming the
    key. An L1 too small to hand out that many pages bounds the reply instead."""
    raw = {"model": {"page_size": 1, "components": {"full": {"layers": 1, "bytes_per_token_per_layer": 1}}},
           "tiers": {"l1": {"tokens": 1 << 28}, "l2": {"size_gb": 1}},
           "server": {"max_tokens_per_request": 1 << 28}}
    with pytest.raises(ConfigError, match=r"server\.max_tokens_per_request: 268435456 tokens can need a reply"):
        build_config(raw)
    raw["tiers"]["l1"]["tokens"] = 1 << 20  # now L1 bounds the pages a reply can list
    cfg = build_config(raw)
    assert cfg.max_reply_bytes == 2 * 4 * (1 << 20) + (1 << 20)


def test_a_named_file_that_cannot_be_read_is_one_error_naming_setting_and_path(tmp_path) -> None:
    """The one reader of files a setting or option names (the daemon's TLS key pair, the
    CLI's --token-file and --ca-file): the caller's error type, one line."""
    pem = tmp_path / "key.pem"
    pem.write_bytes(b"PEM")
    assert read_named_file(str(pem), "server.tls_key", FailedPrecondition) == b"PEM"
    for path, why in ((tmp_path / "missing.pem", "No such file"), (tmp_path, "Is a directory"),
                      (f"{tmp_path}/a\x00b", "null byte"), (f"{tmp_path}/two\nlines", "No such file")):
        with pytest.raises(FailedPrecondition, match=f"server.tls_key=.*cannot read it.*{why}") as e:
            read_named_file(str(path), "server.tls_key", FailedPrecondition)
        assert len(str(e.value).splitlines()) == 1


def test_tensor_parallel_rows_hold_every_ranks_shard() -> None:
    one = load_config(None, ["model.tp_size=1"], env={})
    two = load_config(None, ["model.tp_size=2"], env={})
    assert two.model.rank_members == one.model.members == one.model.rank_members
    assert [m.bytes_per_page_per_layer for m in two.model.members] == [
        2 * m.bytes_per_page_per_layer for m in one.model.members]
    # Daemons of different group sizes never share L3 objects; tp 1 keeps its old seed.
    assert two.model.geometry.endswith(";tp2") and two.model.geometry != one.model.geometry
    assert ";tp" not in one.model.geometry
    # The same L1 bytes hold half as many of the group's rows.
    gb = ["tiers.l1.size_gb=0.25"]
    assert (2 * load_config(None, ["model.tp_size=2", *gb], env={}).l1_pages
            == load_config(None, gb, env={}).l1_pages)


# --------------------------------------------------------------------------- server.tokens_file

SECRET_VALUE = "s3cret-token-value-never-shown"


def _tokens_file(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tokens.yaml"
    path.write_text(text)
    return str(path)


def test_tokens_file_holds_the_token_list(tmp_path: Path) -> None:
    path = _tokens_file(tmp_path, f"- {{token: {SECRET_VALUE}, namespaces: [a, b], name: team-a}}\n"
                                  f"- {{token: {SECRET_VALUE}-2, namespaces: ['*']}}\n")
    cfg = load_config(None, [f"server.tokens_file={path}"])
    assert [(t.token, t.namespaces, t.name) for t in cfg.server.tokens] == [
        (SECRET_VALUE, ("a", "b"), "team-a"), (f"{SECRET_VALUE}-2", ("*",), None)]
    assert cfg.server.tokens_file == path


@pytest.mark.parametrize(("text", "message"), [
    (f"- {{token: {SECRET_VALUE}, namespaces: []}}\n",
     r"server.tokens_file \(.*tokens.yaml\): server.tokens\[0\].namespaces: list at least one"),
    ("- {token: short, namespaces: [a]}\n", r"\[0\].token: must be at least 16 characters"),
    (f"tokens: [{{token: {SECRET_VALUE}, namespaces: [a]}}]\n", r"must hold a YAML list .* got dict"),
    ("[]\n", r"lists no token; list at least one"),
    ("", r"lists no token"),
    (f"- {{token: '{SECRET_VALUE}\n", r"\(.*tokens.yaml\): not valid YAML"),
    (f"- {{token: {SECRET_VALUE}, namespaces: [a], {SECRET_VALUE}: 1}}\n", r"unknown key"),
])
def test_a_bad_tokens_file_is_named_and_its_tokens_never_shown(tmp_path: Path, text: str, message: str) -> None:
    path = _tokens_file(tmp_path, text)
    with pytest.raises(ConfigError, match=message) as info:
        load_config(None, [f"server.tokens_file={path}"])
    assert SECRET_VALUE not in str(info.value)


def test_tokens_file_errors_of_its_own(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"server.tokens_file=.*missing.yaml: cannot read it \(No such file"):
        load_config(None, [f"server.tokens_file={tmp_path / 'missing.yaml'}"])
    with pytest.raises(ConfigError, match=r"server.tokens_file: cannot read .*: not UTF-8"):
        load_config(None, [f"server.tokens_file={_binary(tmp_path)}"])
    with pytest.raises(ConfigError, match=r"server\.tokens_file: an empty path"):
        load_config(None, ["server.tokens_file=''"])
    path = _tokens_file(tmp_path, f"- {{token: {SECRET_VALUE}, namespaces: [a]}}\n")
    with pytest.raises(ConfigError, match=r"server\.tokens and server\.tokens_file: give the tokens in one place"):
        load_config(None, [f"server.tokens_file={path}",
                           f"server.tokens=[{{token: {SECRET_VALUE}x, namespaces: [a]}}]"])


def _binary(tmp_path: Path) -> str:
    path = tmp_path / "binary.yaml"
    path.write_bytes(b"\xff\xfe- token")
    return str(path)
