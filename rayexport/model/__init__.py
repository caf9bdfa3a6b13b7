"""The Hugging Face model a checkpoint belongs to: its folder, config and meta-device model,
the files an export carries and the config it writes (`description`); its on-disk format,
traced from transformers' own save conversion (`conversion`); and its remote code, bundled from
the base model, never a PEFT wrapper (`remote_code`: BRIEF 1.2 is fixed there)."""
