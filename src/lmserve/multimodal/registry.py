"""Architecture name (config.json `architectures`) -> its image preprocessing, read from the model directory.

A vision family adds one line here beside its models/registry.py entry.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from lmserve.multimodal.gemma3 import Gemma3ImageProcessor, Gemma3Processor
from lmserve.multimodal.idefics3 import Idefics3Config, Idefics3Processor
from lmserve.multimodal.llava import CLIPImageProcessor, LlavaProcessor
from lmserve.multimodal.llava_next import LlavaNextProcessor
from lmserve.multimodal.processor import VisionProcessor
from lmserve.multimodal.qwen2_5_vl import Qwen2VLImageProcessor, Qwen25VLProcessor


def _idefics3(path: Path) -> VisionProcessor:
    return Idefics3Processor(Idefics3Config.from_dir(path))


# config.json architecture -> (model directory -> its processor)
PROCESSORS: dict[str, Callable[[Path], VisionProcessor]] = {
    "Idefics3ForConditionalGeneration": _idefics3,
    "SmolVLMForConditionalGeneration": _idefics3,
    "LlavaForConditionalGeneration": LlavaProcessor.from_dir,
    "LlavaNextForConditionalGeneration": LlavaNextProcessor.from_dir,
    "Gemma3ForConditionalGeneration": Gemma3Processor.from_dir,
    "Qwen2_5_VLForConditionalGeneration": Qwen25VLProcessor.from_dir,
}


# architecture -> (preprocessor_config.json's dict, processor_config.json's) -> its processor: a model whose
# settings come from elsewhere (a GGUF projector file: loader/mmproj.py writes them in these files' shape)
FROM_SETTINGS: dict[str, Callable[[dict, dict], VisionProcessor]] = {
    "Idefics3ForConditionalGeneration": lambda pre, proc: Idefics3Processor(Idefics3Config.from_dicts(pre, proc)),
    "Gemma3ForConditionalGeneration": lambda pre, proc: Gemma3Processor(Gemma3ImageProcessor.from_hf(pre),
                                                                        int(proc["mm_tokens_per_image"])),
    "LlavaForConditionalGeneration": lambda pre, proc: LlavaProcessor(CLIPImageProcessor.from_hf(pre),
                                                                      int(proc["image_size"]), int(proc["patch_size"])),
    "Qwen2_5_VLForConditionalGeneration": lambda pre, proc: Qwen25VLProcessor(Qwen2VLImageProcessor.from_hf(pre)),
}


def processor_from_settings(architecture: str, preprocessor: dict, processor: dict) -> VisionProcessor | None:
    """The processor of an architecture from its settings' dicts (None: no vision preprocessing for it)."""
    make = FROM_SETTINGS.get(architecture)
    return None if make is None else make(preprocessor, processor)


def processor_for(architecture: str, path: Path | None) -> VisionProcessor | None:
    """The processor of a vision model's architecture (None: a text-only model, or no directory to read it from)."""
    make = PROCESSORS.get(architecture)
    return None if make is None or path is None else make(Path(path))
