"""Hugging Face Hub ids (`--model org/name`): a local snapshot from the Hub cache, downloaded when allowed.

`huggingface_hub.snapshot_download` looks in the local cache first and honours HF_HUB_OFFLINE,
HF_HOME / HF_HUB_CACHE and HF_TOKEN, so an id works offline once it is cached. Only what lmserve
reads is fetched: config, tokenizer and safetensors files (never pickles, never a repo's many GGUFs).
"""

from __future__ import annotations

import re
from pathlib import Path

from lmserve.errors import ConfigError

# "org/name": what `transformers` and vLLM accept as a repo id (no leading dot, slash or tilde: those are paths).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.txt"]


def looks_like_hub_id(model: str) -> bool:
    """True for `org/name` that is not also a path on disk."""
    return bool(_HUB_ID.match(model)) and not Path(model).exists()


def download_snapshot(repo_id: str, revision: str | None = None) -> Path:
    """The local directory of `repo_id` at `revision`; ConfigError saying what to do when it cannot be had."""
    import huggingface_hub
    from huggingface_hub import errors

    fix = (f"run `hf download {repo_id}` on a machine with network access (same HF_HOME), "
           "or pass a local path to --model")
    try:
        return Path(huggingface_hub.snapshot_download(repo_id, revision=revision, allow_patterns=ALLOW_PATTERNS))
    except errors.HFValidationError as e:
        raise ConfigError(f"model {repo_id}: not a valid Hugging Face Hub id ({e})") from None
    except errors.GatedRepoError:
        raise ConfigError(f"model {repo_id}: the repository is gated; accept its terms on huggingface.co and set "
                          "HF_TOKEN to a token of that account") from None
    except errors.RepositoryNotFoundError:
        raise ConfigError(f"model {repo_id}: no such repository on the Hugging Face Hub (or it is private: set "
                          "HF_TOKEN), and no such local path") from None
    except errors.RevisionNotFoundError:
        raise ConfigError(f"model {repo_id}: revision {revision!r} does not exist") from None
    except (errors.LocalEntryNotFoundError, errors.OfflineModeIsEnabled):
        raise ConfigError(f"model {repo_id}: not in the local Hugging Face cache and the Hub cannot be reached "
                          f"(offline or no network); {fix}") from None
    except (errors.HfHubHTTPError, OSError) as e:
        raise ConfigError(f"model {repo_id}: download from the Hugging Face Hub failed ({e}); {fix}") from None
