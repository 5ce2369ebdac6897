"""Operators edit engines and fleet limits in the admin, with validation, and
see where the catalog's models are placed."""

import pytest
from django.contrib import admin
from django.urls import reverse

from catalog.models import ModelConfig
from fleet.models import (
    ConcurrencyOverride,
    ConcurrencySettings,
    EngineSpec,
    EngineState,
    ThermalOverride,
    ThermalSettings,
)
from tests.factories import EngineSpecFactory, ModelConfigFactory

pytestmark = pytest.mark.django_db


def inline_management(prefix: str, total: int, initial: int = 0) -> dict:
    return {
        f"{prefix}-TOTAL_FORMS": str(total),
        f"{prefix}-INITIAL_FORMS": str(initial),
        f"{prefix}-MIN_NUM_FORMS": "0",
        f"{prefix}-MAX_NUM_FORMS": "1000",
    }


def thermal_post(**overrides) -> dict:
    data = {"cpu_high": "90", "cpu_resume": "80", "gpu_high": "85", "gpu_resume": "75"}
    data.update(inline_management("overrides", 0))
    data.update(overrides)
    return data


def thermal_url() -> str:
    return reverse("admin:fleet_thermalsettings_change", args=[1])


def test_singleton_list_opens_the_one_row(admin_client):
    """The settings list view goes straight to the only row."""
    response = admin_client.get(reverse("admin:fleet_thermalsettings_changelist"))
    assert response.status_code == 302
    assert response.url == thermal_url()


def test_resume_not_below_high_is_an_error_and_nothing_is_saved(admin_client):
    """Resume >= high shows an error and the stored thresholds stay as they were."""
    response = admin_client.post(thermal_url(), thermal_post(cpu_resume="95"))
    assert response.status_code == 200
    assert "must be below high" in response.content.decode()
    settings = ThermalSettings.load()
    assert (settings.cpu_high, settings.cpu_resume) == (90, 80)


def test_vendor_override_inline_is_validated_and_saved(admin_client):
    """A per-vendor override row is saved from the inline; a bad one is refused."""
    bad = thermal_post(
        **inline_management("overrides", 1),
        **{"overrides-0-vendor": "amd", "overrides-0-high": "95"},
        **{"overrides-0-resume": "96"},
    )
    response = admin_client.post(thermal_url(), bad)
    assert response.status_code == 200
    assert "must be below high" in response.content.decode()
    assert not ThermalOverride.objects.exists()

    good = dict(bad, **{"overrides-0-resume": "92"})
    response = admin_client.post(thermal_url(), good)
    assert response.status_code == 302
    override = ThermalOverride.objects.get()
    assert (override.vendor, override.high, override.resume) == ("amd", 95, 92)


def test_concurrency_override_per_engine(admin_client):
    """Per-engine concurrency overrides are edited inline; empty keeps the default."""
    gpu = EngineSpecFactory(name="gpu0", backend="cuda")
    url = reverse("admin:fleet_concurrencysettings_change", args=[1])
    data = {
        "max_parallel_requests": "4",
        "max_slots_per_model": "2",
        "kv_cache_mib": "512",
        **inline_management("overrides", 1),
        "overrides-0-engine": str(gpu.pk),
        "overrides-0-max_parallel_requests": "8",
        "overrides-0-max_slots_per_model": "",
        "overrides-0-kv_cache_mib": "2048",
    }
    response = admin_client.post(url, data)
    assert response.status_code == 302
    override = ConcurrencyOverride.objects.get()
    assert override.settings == ConcurrencySettings.load()
    assert (override.max_parallel_requests, override.max_slots_per_model) == (8, None)

    from fleet.selectors import engine_limits

    limits = engine_limits(spec=gpu)
    assert (limits.max_parallel_requests, limits.max_slots_per_model) == (8, 2)
    assert limits.kv_cache_mib == 2048
    other = engine_limits(spec=EngineSpecFactory(name="cpu9"))
    assert (other.max_parallel_requests, other.kv_cache_mib) == (4, 512)


def engine_post(**fields) -> dict:
    data = {
        "name": "gpu0",
        "backend": "cuda",
        "enabled": "on",
        "order": "1",
        "port": "",
        "devices": "GPU-1234",
        "env": "",
        **inline_management("state", 0),
    }
    data.update(fields)
    return data


def test_engine_env_block_keeps_empty_values(admin_client):
    """KEY= lines are stored as empty strings, not dropped."""
    response = admin_client.post(
        reverse("admin:fleet_enginespec_add"),
        engine_post(env="CUDA_VISIBLE_DEVICES=0\nHIP_VISIBLE_DEVICES=\n# comment\n"),
    )
    assert response.status_code == 302, response.content.decode()
    spec = EngineSpec.objects.get(name="gpu0")
    assert spec.env == {"CUDA_VISIBLE_DEVICES": "0", "HIP_VISIBLE_DEVICES": ""}
    assert spec.effective_capabilities == {"gguf", "transformers", "embedding"}

    change = admin_client.get(reverse("admin:fleet_enginespec_change", args=[spec.pk]))
    assert "HIP_VISIBLE_DEVICES=" in change.content.decode()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("1BAD=x", "Not valid environment variable names"),
        ("BAD-NAME=x", "Not valid environment variable names"),
        ("NO_EQUALS_SIGN", "expected KEY=VALUE"),
        ("A=1\nA=2", "set twice"),
    ],
)
def test_engine_env_block_errors(admin_client, env, message):
    """Invalid variable names and malformed lines are errors; nothing is saved."""
    response = admin_client.post(
        reverse("admin:fleet_enginespec_add"), engine_post(env=env)
    )
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not EngineSpec.objects.filter(name="gpu0").exists()


def test_engine_capability_override(admin_client):
    """Checked capabilities replace the backend's defaults."""
    data = engine_post(capabilities=["gguf"])
    response = admin_client.post(reverse("admin:fleet_enginespec_add"), data)
    assert response.status_code == 302
    assert EngineSpec.objects.get(name="gpu0").effective_capabilities == {"gguf"}


def test_engine_list_shows_live_state(admin_client):
    """The engine list shows the supervisor's status, cooling reason and models."""
    cpu0 = EngineSpec.objects.get(name="cpu0")
    EngineState.objects.create(
        spec=cpu0,
        status="cooling",
        cooling_reason="cpu 93 °C",
        resident_models=[{"name": "all-minilm-l6-v2", "memory_mib": 90}],
    )
    response = admin_client.get(reverse("admin:fleet_enginespec_changelist"))
    body = response.content.decode()
    assert "cooling (cpu 93 °C)" in body
    assert "all-minilm-l6-v2" in body
    assert "8780" in body  # base port + order 0


def test_engine_list_filters_and_search(admin_client):
    """Engines can be filtered by backend and found by name."""
    EngineSpecFactory(name="radeon", backend="vulkan")
    url = reverse("admin:fleet_enginespec_changelist")
    body = admin_client.get(url, {"backend__exact": "vulkan"}).content.decode()
    assert "radeon" in body and ">cpu0<" not in body
    body = admin_client.get(url, {"q": "cpu"}).content.decode()
    assert ">cpu0<" in body and "radeon" not in body


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ("BAD=a\x00b", "contains a NUL character"),
        ("HUGE=" + "x" * 200_000, "HUGE is 200,006 bytes"),
    ],
)
def test_env_blocks_exec_would_refuse_are_errors(admin_client, env, message):
    """A NUL, or a variable over the system's limit, is refused when saved, not
    found when the engine starts; a harmless block is saved (control)."""
    url = reverse("admin:fleet_enginespec_add")
    response = admin_client.post(url, engine_post(env=env))
    assert response.status_code == 200
    assert message in response.content.decode()
    assert not EngineSpec.objects.filter(name="gpu0").exists()
    response = admin_client.post(url, engine_post(env="GOOD=" + "x" * 1000))
    assert response.status_code == 302


@pytest.mark.parametrize(
    ("fields", "other"),
    [
        ({"port": "9100"}, "Port 9100 is already engine 'fixed'"),
        ({"port": "8787"}, "Port 8787 is already engine 'seventh'"),
        ({"order": "5"}, "Port 8785 is already engine 'pinned'"),
        ({"order": "7"}, "Port 8787 is already engine 'seventh'"),
    ],
)
def test_two_engines_on_one_port_are_refused(admin_client, fields, other):
    """A fixed port another engine has, a fixed port equal to another's base
    port + order, or a base port + order equal to another's port: refused,
    naming the other engine; a free order is saved (control)."""
    EngineSpecFactory(name="fixed", port=9100)
    EngineSpecFactory(name="pinned", port=8785)
    EngineSpecFactory(name="seventh", order=7)
    url = reverse("admin:fleet_enginespec_add")
    response = admin_client.post(url, engine_post(**fields))
    assert response.status_code == 200
    assert other.replace("'", "&#x27;") in response.content.decode()
    assert not EngineSpec.objects.filter(name="gpu0").exists()
    response = admin_client.post(url, engine_post(order="6"))
    assert response.status_code == 302


def test_a_base_port_that_gives_two_engines_one_port_is_refused(admin_client):
    """Moving the base port onto another engine's fixed port is refused."""
    EngineSpecFactory(name="fixed", port=9100)
    url = reverse("admin:fleet_serversettings_change", args=[1])
    data = {
        "models_max": "3",
        "memory_margin_mib": "512",
        "queue_limit": "64",
        "queue_timeout_s": "60",
        "stuck_after_s": "60",
    }
    response = admin_client.post(url, {**data, "base_port": "9100"})
    assert response.status_code == 200
    assert "would both get port 9100" in response.content.decode()
    response = admin_client.post(url, {**data, "base_port": "9200"})
    assert response.status_code == 302


def test_model_list_shows_pin_status(admin_client):
    """The list flags a model whose pin cannot be honoured."""
    ModelConfig.objects.filter(name="gemma3-270m").update(engine_pin="gpu7")
    body = admin_client.get(reverse("admin:catalog_modelconfig_changelist")).content
    assert "engine &#x27;gpu7&#x27; does not exist" in body.decode()


def test_engine_pin_input_suggests_engines(admin_client):
    """The pin field offers the configured engine names."""
    body = admin_client.get(reverse("admin:catalog_modelconfig_add")).content.decode()
    assert '<option value="cpu0">' in body


def test_list_shows_each_models_owner_engine(admin_client):
    """Owners: a pin wins; the rest go to a compatible engine (vulkan engines
    serve GGUF only, so not the embedder)."""
    ModelConfig.objects.all().delete()
    EngineSpecFactory(name="cpu0"), EngineSpecFactory(name="cpu1")
    EngineSpecFactory(name="vk", backend="vulkan")
    ModelConfigFactory(name="pinned", engine_pin="vk")
    ModelConfigFactory(name="embedder", format="embedding", task="embedding")
    response = admin_client.get(reverse("admin:catalog_modelconfig_changelist"))
    assert response.status_code == 200
    assert "owner engine" in response.content.decode().lower()
    listed = admin.site._registry[ModelConfig]
    assert listed.owner(ModelConfig.objects.get(name="pinned")) == "vk"
    assert listed.owner(ModelConfig.objects.get(name="embedder")) in ("cpu0", "cpu1")


def test_model_change_form_shows_owner_engine_and_memory_where_resident(
    admin_client,
):
    """The model's change form says which engine owns it and which engines
    hold it now, with the memory it takes there (the supervisor's record)."""
    ModelConfig.objects.all().delete()
    engine = EngineSpecFactory(name="cpu0")
    model = ModelConfigFactory(name="chatty", measured_memory_mib=321)
    url = reverse("admin:catalog_modelconfig_change", args=[model.pk])
    body = admin_client.get(url).content.decode()
    assert "Owner engine" in body and "no engine holds it now" in body
    EngineState.objects.create(
        spec=engine,
        status="ready",
        resident_models=[{"name": "chatty", "memory_mib": 312.4}],
    )
    body = admin_client.get(url).content.decode()
    assert "cpu0 (312 MiB)" in body
    assert "321" in body  # the memory its last load measured
    # A generation model: the slots chosen and the KV pool they share.
    EngineState.objects.filter(spec=engine).update(
        resident_models=[
            {
                "name": "chatty",
                "memory_mib": 312.4,
                "slots": 8,
                "slots_auto": True,
                "context": 2048,
                "kv_pool_tokens": 16384,
                "kv_mib": 360.0,
                "kv_groups": 2,
            }
        ]
    )
    body = admin_client.get(url).content.decode()
    assert (
        "cpu0 (312 MiB): 8 slots (auto) sharing a 16,384-token KV pool (360 MiB) "
        "in 2 groups, up to 2,048 tokens per conversation"
    ) in body
    # One whose pool holds every slot's context: a KV stream per slot.
    EngineState.objects.filter(spec=engine).update(
        resident_models=[
            {
                "name": "chatty",
                "memory_mib": 312.4,
                "slots": 8,
                "slots_auto": True,
                "context": 2048,
                "kv_pool_tokens": 16384,
                "kv_mib": 360.0,
                "kv_groups": 1,
                "kv_streams": True,
            }
        ]
    )
    body = admin_client.get(url).content.decode()
    assert (
        "cpu0 (312 MiB): 8 slots (auto), a KV stream of 2,048 tokens each "
        "(360 MiB in all)"
    ) in body
    # A GGUF model on a GPU engine: its offload plan there.
    offload = {
        "gpu_layers": 18,
        "layers": 31,
        "cards_mib": {"gpu-0": 6246.4},
        "cpu_mib": 2900.0,
        "reason": "18 of 31 layers on 1 card (gpu-0 6.1 GiB), 13 on the CPU",
    }
    EngineState.objects.filter(spec=engine).update(
        resident_models=[{"name": "chatty", "memory_mib": 312.4, "offload": offload}]
    )
    body = admin_client.get(url).content.decode()
    assert (
        "cpu0 (312 MiB); 18 of 31 layers on 1 card (gpu-0 6.1 GiB), 13 on the CPU"
    ) in body
