"""Data shipped with CoLLM: a Dolly-15k subset (CC BY-SA 3.0) and the Azure LLM conv trace (CC BY 4.0)."""

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent
DOLLY_SUBSET = DATA_DIR / "dolly" / "dolly-subset.jsonl"
AZURE_CONV_TRACE = DATA_DIR / "traces" / "AzureLLMInferenceTrace_conv.csv"
