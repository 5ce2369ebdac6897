"""The catalog admin's model form, as the admin posts it."""

from django.urls import reverse


def model_post(**fields) -> dict:
    """The add form's fields: a valid GGUF chat model, with `fields` over them."""
    data = {
        "name": "qwen-test",
        "format": "gguf",
        "task": "chat",
        "path": "SmolLM2-135M-Instruct.Q4_1.gguf",
        "enabled": "on",
        "engine_pin": "",
        "replicas": "1",
        "node_labels": "[]",
        "avoid_labels": "[]",
        "context_length": "",
        "slots": "",
        "batch_window_ms": "5",
        "max_batch_size": "64",
        "keep_alive_s": "300",
        "sampling": "{}",
        "chat_template": "",
        "context_overflow": "refuse",
        "gpu_layers": "auto",
        "tensor_split": "",
        "dtype": "auto",
        "max_gpu_percent": "90",
    }
    data.update(fields)
    return data


def model_add(admin_client, **fields):
    """The admin's response to the add form posted with `fields`."""
    return admin_client.post(
        reverse("admin:catalog_modelconfig_add"), model_post(**fields)
    )
