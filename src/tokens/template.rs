//! A model's chat template, rendered as vLLM renders it before it counts a chat prompt:
//! `tokenizer.apply_chat_template(messages, tools, add_generation_prompt=True, tokenize=False)`,
//! whose text is then encoded with the added tokens it contains. The template comes from the
//! model's `tokenizer_config.json` and runs in minijinja, set up like `transformers`' Jinja
//! environment: `trim_blocks`, `lstrip_blocks`, loop controls, Python's string and dict methods,
//! `raise_exception`, `strftime_now`, and the special tokens as variables.
//!
//! Pure: `strftime_now` answers a fixed date whatever the format (templates ask for
//! `%d %b %Y`, "26 Jul 2024"; another day costs the same handful of tokens, give or take one),
//! so a count never depends on the clock.

use minijinja::value::Kwargs;
use minijinja::{Environment, Error, ErrorKind, Value as Jinja};
use serde_json::Value;

/// The name the template is registered under in its environment.
const NAME: &str = "chat";
/// What `strftime_now` renders, whatever the format: a day as `%d %b %Y` spells it.
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
        env.add_filter("tojson", python_tojson);
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

/// `tojson` as `transformers` defines it: Python's `json.dumps(value, ensure_ascii=False,
/// indent=indent, separators=separators, sort_keys=sort_keys)`, so tool definitions render with
/// the same spacing and characters as upstream (minijinja's own `tojson` is compact and escapes
/// HTML). One difference stays: maps come out with their keys sorted, where Python keeps the
/// client's order (the same text, reordered).
fn python_tojson(value: Jinja, kwargs: Kwargs) -> Result<String, Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    let _sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    kwargs.assert_all_used()?;
    let json = serde_json::to_value(&value)
        .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?;
    let (item, key) = match separators.as_deref() {
        Some([item, key]) => (item.clone(), key.clone()),
        _ if indent.is_some() => (",".to_owned(), ": ".to_owned()),
        _ => (", ".to_owned(), ": ".to_owned()),
    };
    let style = Style {
        indent,
        ensure_ascii: ensure_ascii.unwrap_or(false),
        item,
        key,
    };
    let mut out = String::new();
    style.write(&json, 0, &mut out);
    Ok(out)
}

struct Style {
    indent: Option<usize>,
    ensure_ascii: bool,
    item: String,
    key: String,
}

impl Style {
    fn write(&self, value: &Value, depth: usize, out: &mut String) {
        match value {
            Value::Array(items) if !items.is_empty() => {
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.write(item, depth + 1, out);
                }
                self.close(depth, out);
                out.push(']');
            }
            Value::Object(map) if !map.is_empty() => {
                out.push('{');
                for (i, (k, v)) in map.iter().enumerate() {
                    self.separate(i, depth + 1, out);
                    self.string(k, out);
                    out.push_str(&self.key);
                    self.write(v, depth + 1, out);
                }
                self.close(depth, out);
                out.push('}');
            }
            Value::Array(_) => out.push_str("[]"),
            Value::Object(_) => out.push_str("{}"),
            Value::String(s) => self.string(s, out),
            Value::Null => out.push_str("null"),
            other => out.push_str(&other.to_string()),
        }
    }

    /// Before item `i`: the item separator (not before the first), then the indentation.
    fn separate(&self, i: usize, depth: usize, out: &mut String) {
        if i > 0 {
            match self.indent {
                // Python strips the trailing space of the item separator when indenting.
                Some(_) => out.push_str(self.item.trim_end()),
                None => out.push_str(&self.item),
            }
        }
        if let Some(indent) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(indent * depth));
        }
    }

    fn close(&self, depth: usize, out: &mut String) {
        if let Some(indent) = self.indent {
            out.push('\n');
            out.push_str(&" ".repeat(indent * depth));
        }
    }

    /// A JSON string as Python writes it: `\n`, `\t` and friends by name, other control
    /// characters as `\u00XX`, and with `ensure_ascii` everything past ASCII as `\uXXXX`.
    fn string(&self, s: &str, out: &mut String) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{8}' => out.push_str("\\b"),
                '\u{c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 || (self.ensure_ascii && !c.is_ascii()) => {
                    let mut units = [0u16; 2];
                    for unit in c.encode_utf16(&mut units) {
                        out.push_str(&format!("\\u{unit:04x}"));
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}
