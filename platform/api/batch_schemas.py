"""The typed request body of POST /v1/batches (batches.views), here so that
/v1/openapi.json documents it (api.openapi): the endpoint and window it
names are the batch's own checks (batches.services.batch_create), which answer
400 naming the field."""

from typing import Annotated

from pydantic import Field, StringConstraints

from .schema_base import Strict


class BatchRequest(Strict):
    """POST /v1/batches."""

    input_file_id: Annotated[str, StringConstraints(min_length=1, max_length=64)]
    endpoint: str
    completion_window: str
    metadata: (
        Annotated[
            dict[
                Annotated[str, StringConstraints(max_length=64)],
                Annotated[str, StringConstraints(max_length=512)],
            ],
            Field(max_length=16),
        ]
        | None
    ) = None
