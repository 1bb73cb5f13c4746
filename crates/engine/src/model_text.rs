//! The text side of a model: its tokenizer, chat template and generation defaults, read from a
//! model directory's Hugging Face files (`tokenizer.json`, `tokenizer_config.json` or
//! `chat_template.jinja`, `generation_config.json`) or from a GGUF file's metadata
//! ([`deltamoe_model::gguf::vocab`]).

use std::path::{Path, PathBuf};

use deltamoe_model::gguf::{vocab, GgufFile};
use deltamoe_model::ModelSource;

use crate::chat::ChatTemplate;
use crate::error::{EngineError, Result};
use crate::generation_config::GenerationDefaults;
use crate::sampler::SamplingParams;
use crate::tokenizer::TextTokenizer;

/// A model's tokenizer, chat template and generation defaults.
pub struct ModelText {
    /// `None` for a directory without `tokenizer.json`.
    pub tokenizer: Option<TextTokenizer>,
    pub template: Option<ChatTemplate>,
    /// What the files say, before the model config's end-of-sequence ids are added.
    pub generation: GenerationDefaults,
    /// The directory or GGUF file they came from.
    pub origin: PathBuf,
}

impl ModelText {
    /// The text side of the model at `path` (a model directory or a GGUF file).
    pub fn load(path: &Path) -> Result<ModelText> {
        match ModelSource::resolve(path)? {
            ModelSource::Dir(d) => Self::from_dir(&d),
            ModelSource::Gguf(f) => Self::from_gguf(&GgufFile::open(&f)?),
        }
    }

    /// From a model directory's files; each is optional.
    pub fn from_dir(dir: &Path) -> Result<ModelText> {
        Ok(ModelText {
            tokenizer: TextTokenizer::from_dir(dir)?,
            template: ChatTemplate::from_dir(dir)?,
            generation: GenerationDefaults::from_dir(dir, &[])?,
            origin: dir.to_path_buf(),
        })
    }

    /// From a GGUF file's metadata.
    pub fn from_gguf(f: &GgufFile) -> Result<ModelText> {
        let v = vocab::vocab(f)?;
        let file_err = |msg: String| EngineError::File {
            path: f.path().to_path_buf(),
            msg,
        };
        let template = match &v.chat_template {
            Some(src) => Some(
                ChatTemplate::from_str(src)
                    .map_err(|e| file_err(format!("metadata `tokenizer.chat_template`: {e}")))?
                    .with_special_tokens(v.bos_token.clone(), v.eos_token.clone()),
            ),
            None => None,
        };
        let sampling = v.sampling.as_ref().map(|s| SamplingParams {
            temperature: s.temperature.unwrap_or(1.0),
            top_p: s.top_p.unwrap_or(1.0),
            top_k: s.top_k.unwrap_or(50),
            min_p: s.min_p.unwrap_or(0.0),
            repetition_penalty: s.repetition_penalty.unwrap_or(1.0),
            ..SamplingParams::default()
        });
        if let Some(s) = &sampling {
            s.validate()
                .map_err(|e| file_err(format!("metadata `general.sampling.*`: {e}")))?;
        }
        Ok(ModelText {
            tokenizer: Some(TextTokenizer::from_json(&v.tokenizer_json, f.path())?),
            template,
            generation: GenerationDefaults {
                eos_token_ids: v.eos_ids,
                sampling,
                bos_token_id: v.bos_id,
            },
            origin: f.path().to_path_buf(),
        })
    }

    /// The generation defaults, with the model config's end-of-sequence ids `config_eos` added.
    pub fn defaults(&self, config_eos: &[u32]) -> GenerationDefaults {
        self.generation.clone().with_eos(config_eos)
    }
}
