//! A model's chat template, rendered as vLLM renders it before it counts a chat prompt:
//! `tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True, tokenize=False)`,
//! whose text is then encoded with the added tokens it contains. The template comes from the
//! model's `tokenizer_config.json` and runs in minijinja, set up like `transformers`' Jinja
//! environment: `trim_blocks`, `lstrip_blocks`, loop controls, Python's string and dict methods,
//! `raise_exception`, `strftime_now`, and the special tokens as variables.
//!
//! Pure: `strftime_now` answers a fixed date (a date is the same handful of tokens whatever the
//! day), so a count never depends on the clock.

use minijinja::{Environment, Error, ErrorKind, Value as Jinja};
use serde_json::Value;

/// The name the template is registered under in its environment.
const NAME: &str = "chat";
/// What `strftime_now` renders, whatever the format: a day of the right shape.
const FIXED_DATE: &str = "26 Jul 2024";

/// A compiled chat template and the special tokens it refers to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// `bos_token`, `eos_token`, ... as the tokenizer config names them.
    special: Vec<(String, String)>,
}

impl ChatTemplate {
    /// From the text of a `tokenizer_config.json`: its `chat_template` (a string, or the one
    /// named `default` in a list of named templates) and its special tokens.
    pub fn from_tokenizer_config(text: &str) -> Result<ChatTemplate, String> {
        let config: Value = serde_json::from_str(text)
            .map_err(|e| format!("not a tokenizer_config.json (invalid JSON: {e})"))?;
        let source = match config.get("chat_template") {
            Some(Value::String(s)) => s.clone(),
            Some(Value::Array(named)) => named
                .iter()
                .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
                .and_then(|t| t.get("template"))
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or("a list of templates without one named \"default\"")?,
            _ => return Err("the file has no chat_template".into()),
        };
        let mut special = Vec::new();
        for key in ["bos_token", "eos_token", "unk_token", "pad_token"] {
            let token = match config.get(key) {
                Some(Value::String(s)) => s.clone(),
                // `{"content": "<s>", ...}`, as older configs spell an added token.
                Some(Value::Object(o)) => match o.get("content") {
                    Some(Value::String(s)) => s.clone(),
                    _ => continue,
                },
                _ => continue,
            };
            special.push((key.to_owned(), token));
        }
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<Jinja, Error> {
                Err(Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_function("strftime_now", |_format: String| FIXED_DATE.to_owned());
        env.add_template_owned(NAME, source)
            .map_err(|e| format!("the template does not compile: {e}"))?;
        Ok(ChatTemplate { env, special })
    }

    /// The prompt the model would see for `messages` (and `tools`, if any), with the
    /// generation prompt added. `Err` names what the template refused or could not do.
    pub fn render(&self, messages: &Value, tools: Option<&Value>) -> Result<String, String> {
        let template = self.env.get_template(NAME).map_err(|e| e.to_string())?;
        let mut context: Vec<(&str, Jinja)> = vec![
            ("messages", Jinja::from_serialize(messages)),
            ("add_generation_prompt", Jinja::from(true)),
        ];
        if let Some(tools) = tools {
            context.push(("tools", Jinja::from_serialize(tools)));
        }
        for (key, token) in &self.special {
            context.push((key.as_str(), Jinja::from(token.as_str())));
        }
        let context: Jinja = context.into_iter().collect();
        template.render(context).map_err(|e| e.to_string())
    }
}
