//! The files a configuration names, read when a policy is built: a model's tokenizer and chat
//! template (`tokens.encodings[].tokenizer_file`, `chat_template_file`). The policy's only I/O,
//! kept out of `policy.rs` (deciding code, `architecture::DECIDING`): it happens once per
//! configuration, at start-up or in `check-config`, never per request.

use sha2::{Digest, Sha256};

use super::LoadedTokenizer;
use crate::tokens::{Encoding, EncodingRule, ModelVocabulary};

/// A rule's encoding: the one it names, or the model's tokenizer built from its files (read
/// here, the one place a configuration is judged; built once per distinct contents). An error
/// starts with the field it is about (`.tokenizer_file: ...`).
pub(super) fn resolve_encoding(
    rule: &EncodingRule,
) -> Result<(Encoding, Option<LoadedTokenizer>), String> {
    let path = match (&rule.encoding, &rule.tokenizer_file) {
        (Some(encoding), None) => {
            if rule.chat_template_file.is_some() {
                return Err(
                    ".chat_template_file: only with tokenizer_file (OpenAI's encodings \
                            are framed by tokens.per_message and friends)"
                        .to_owned(),
                );
            }
            return Ok((*encoding, None));
        }
        (None, Some(path)) => path,
        (Some(_), Some(_)) => {
            return Err(": name either encoding or tokenizer_file, not both".to_owned());
        }
        (None, None) => return Err(": name an encoding or a tokenizer_file".to_owned()),
    };
    let read = |field: &str, path: &std::path::Path| {
        std::fs::read_to_string(path)
            .map_err(|e| format!(".{field}: cannot read {}: {e}", path.display()))
    };
    let tokenizer = read("tokenizer_file", path)?;
    let template = match &rule.chat_template_file {
        Some(template_path) => Some((template_path, read("chat_template_file", template_path)?)),
        None => None,
    };
    let mut digest = Sha256::new();
    digest.update(tokenizer.len().to_le_bytes());
    digest.update(&tokenizer);
    if let Some((_, text)) = &template {
        digest.update(text);
    }
    let key: [u8; 32] = digest.finalize().into();
    // Held while building, so two policies loading the same files build them once; a later
    // policy (the server's start after `check-config`, a reload) reuses the vocabulary and
    // reports the memory measured when it was built.
    let mut loaded = LOADED
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let (vocabulary, grew) = match loaded.iter().find(|(k, _, _)| *k == key) {
        Some(&(_, vocabulary, grew)) => (vocabulary, grew),
        None => {
            let before = resident_bytes();
            let built = ModelVocabulary::from_json(
                &path.display().to_string(),
                &tokenizer,
                template.as_ref().map(|(_, text)| text.as_str()),
            )
            .map_err(|problem| {
                match (&template, problem.starts_with("chat_template")) {
                    (Some((template_path, _)), true) => {
                        format!(
                            ".chat_template_file: {}: {problem}",
                            template_path.display()
                        )
                    }
                    _ => format!(".tokenizer_file: {}: {problem}", path.display()),
                }
            })?;
            // Kept for the rest of the process: the request path copies a pointer to it.
            let vocabulary: &'static ModelVocabulary = Box::leak(Box::new(built));
            let grew = match (before, resident_bytes()) {
                (Some(before), Some(after)) => Some(after.saturating_sub(before)),
                _ => None,
            };
            loaded.push((key, vocabulary, grew));
            (vocabulary, grew)
        }
    };
    drop(loaded);
    Ok((
        Encoding::Model(vocabulary),
        Some(LoadedTokenizer {
            pattern: rule.pattern.clone(),
            vocabulary,
            resident_bytes: grew,
        }),
    ))
}

/// Every vocabulary built so far, by the digest of the files it was built from, with how much
/// resident memory building it took.
type Loaded = Vec<([u8; 32], &'static ModelVocabulary, Option<u64>)>;
static LOADED: std::sync::Mutex<Loaded> = std::sync::Mutex::new(Vec::new());

/// The process's resident memory, from `VmRSS` in `/proc/self/status` (Linux); `None` elsewhere.
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
