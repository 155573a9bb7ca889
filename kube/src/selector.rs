//! Kubernetes label selectors in their text form, as `kubectl -l` and
//! upstream's `--lease-label-selector` take them: `key=value`, `key==value`,
//! `key!=value`, `key in (a,b)`, `key notin (a,b)`, `key`, `!key`,
//! `key>1`, `key<1`, joined by commas (all must hold).
//!
//! The agent only checks and normalises a selector: kube-apiserver does the
//! matching (it is sent as `labelSelector`). Checking here turns a typo into
//! an error at start naming the flag, where kube-apiserver would refuse
//! every list with a 400, and normalising sorts the terms by key as
//! apimachinery's `labels.Parse` does, so logs show what kube-apiserver
//! will evaluate.

use std::collections::BTreeMap;
use std::fmt;

/// Why a selector was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SelectorError {
    #[error("{found} where a label key was expected")]
    KeyExpected { found: String },
    #[error("{found} after key {key:?}; expected one of =, ==, !=, in, notin, >, <, or a comma")]
    OperatorExpected { key: String, found: String },
    #[error("{found} after the term {term:?}; expected a comma between terms")]
    CommaExpected { term: String, found: String },
    #[error("{found} after \"{key} {operator}\"; expected a parenthesised list of values")]
    ListExpected {
        key: String,
        operator: &'static str,
        found: String,
    },
    #[error("{found} in the values of {key:?}; expected a value, a comma or ')'")]
    ValueExpected { key: String, found: String },
    #[error("the values of \"{key} {operator}\" must not be empty")]
    EmptyList { key: String, operator: &'static str },
    #[error("invalid label key {key:?}: {problem}")]
    Key { key: String, problem: String },
    #[error("invalid value {value:?} for {key:?}: {problem}")]
    Value {
        key: String,
        value: String,
        problem: String,
    },
}

/// How a term relates a label to its values.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Operator {
    Equals,
    DoubleEquals,
    NotEquals,
    In,
    NotIn,
    Exists,
    DoesNotExist,
    GreaterThan,
    LessThan,
}

/// One comma-separated term of a selector.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Requirement {
    key: String,
    operator: Operator,
    /// Sorted and without duplicates for `in` and `notin`; one value for
    /// the comparisons; none for `key` and `!key`.
    values: Vec<String>,
}

/// A checked label selector; `Display` gives its normal form. The empty
/// selector selects everything.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LabelSelector(Vec<Requirement>);

impl LabelSelector {
    pub fn parse(text: &str) -> Result<Self, SelectorError> {
        let mut tokens = Lexer::new(text);
        let mut requirements = Vec::new();
        if tokens.peek() == Token::End {
            return Ok(LabelSelector(requirements));
        }
        loop {
            requirements.push(requirement(&mut tokens)?);
            match tokens.next() {
                Token::End => break,
                Token::Comma => continue,
                other => {
                    let term = requirements.last().map(ToString::to_string).unwrap_or_default();
                    return Err(SelectorError::CommaExpected {
                        term,
                        found: other.describe(),
                    });
                }
            }
        }
        // Stable, as apimachinery's: terms with the same key keep their order.
        requirements.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(LabelSelector(requirements))
    }

    /// Whether it selects every object (no terms).
    pub fn is_everything(&self) -> bool {
        self.0.is_empty()
    }
}

impl fmt::Display for LabelSelector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, requirement) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{requirement}")?;
        }
        Ok(())
    }
}

impl fmt::Display for Requirement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = &self.key;
        let values = self.values.join(",");
        match self.operator {
            Operator::Equals => write!(f, "{key}={values}"),
            Operator::DoubleEquals => write!(f, "{key}=={values}"),
            Operator::NotEquals => write!(f, "{key}!={values}"),
            Operator::GreaterThan => write!(f, "{key}>{values}"),
            Operator::LessThan => write!(f, "{key}<{values}"),
            Operator::In => write!(f, "{key} in ({values})"),
            Operator::NotIn => write!(f, "{key} notin ({values})"),
            Operator::Exists => write!(f, "{key}"),
            Operator::DoesNotExist => write!(f, "!{key}"),
        }
    }
}

/// One term: `!key`, `key`, `key <op> value` or `key in|notin (values)`.
fn requirement(tokens: &mut Lexer<'_>) -> Result<Requirement, SelectorError> {
    let negated = tokens.peek() == Token::Not;
    if negated {
        tokens.next();
    }
    let key = match tokens.next() {
        Token::Word(word) => word.to_owned(),
        other => {
            return Err(SelectorError::KeyExpected {
                found: other.describe(),
            });
        }
    };
    check_key(&key)?;
    if negated {
        return Ok(Requirement {
            key,
            operator: Operator::DoesNotExist,
            values: Vec::new(),
        });
    }
    let operator = match tokens.peek() {
        Token::Comma | Token::End => {
            return Ok(Requirement {
                key,
                operator: Operator::Exists,
                values: Vec::new(),
            });
        }
        Token::Equals => Operator::Equals,
        Token::DoubleEquals => Operator::DoubleEquals,
        Token::NotEquals => Operator::NotEquals,
        Token::GreaterThan => Operator::GreaterThan,
        Token::LessThan => Operator::LessThan,
        Token::Word("in") => Operator::In,
        Token::Word("notin") => Operator::NotIn,
        other => {
            return Err(SelectorError::OperatorExpected {
                key,
                found: other.describe(),
            });
        }
    };
    tokens.next();
    let values = match operator {
        Operator::In | Operator::NotIn => value_list(tokens, &key, operator)?,
        _ => vec![single_value(tokens, &key, operator)?],
    };
    Ok(Requirement {
        key,
        operator,
        values,
    })
}

/// The value after `=`, `==`, `!=`, `>` or `<`; `key=` means the empty value.
fn single_value(tokens: &mut Lexer<'_>, key: &str, operator: Operator) -> Result<String, SelectorError> {
    let value = match tokens.peek() {
        Token::Comma | Token::End => String::new(),
        Token::Word(word) => {
            tokens.next();
            word.to_owned()
        }
        other => {
            return Err(SelectorError::ValueExpected {
                key: key.to_owned(),
                found: other.describe(),
            });
        }
    };
    if matches!(operator, Operator::GreaterThan | Operator::LessThan) {
        if value.parse::<i64>().is_err() {
            return Err(SelectorError::Value {
                key: key.to_owned(),
                value,
                problem: "> and < compare with an integer".to_owned(),
            });
        }
    } else {
        check_value(key, &value)?;
    }
    Ok(value)
}

/// `(a,b,...)` after `in` or `notin`: sorted, duplicates dropped.
fn value_list(tokens: &mut Lexer<'_>, key: &str, operator: Operator) -> Result<Vec<String>, SelectorError> {
    let name = if operator == Operator::In { "in" } else { "notin" };
    match tokens.next() {
        Token::Open => {}
        other => {
            return Err(SelectorError::ListExpected {
                key: key.to_owned(),
                operator: name,
                found: other.describe(),
            });
        }
    }
    let mut values = Vec::new();
    // A value may be empty (`(a,)` holds "a" and ""), as apimachinery reads it.
    let mut current = String::new();
    loop {
        match tokens.next() {
            Token::Word(word) if current.is_empty() => current = word.to_owned(),
            Token::Comma => values.push(std::mem::take(&mut current)),
            Token::Close => {
                if !(values.is_empty() && current.is_empty()) {
                    values.push(current);
                }
                break;
            }
            other => {
                return Err(SelectorError::ValueExpected {
                    key: key.to_owned(),
                    found: other.describe(),
                });
            }
        }
    }
    if values.is_empty() {
        return Err(SelectorError::EmptyList {
            key: key.to_owned(),
            operator: name,
        });
    }
    for value in &values {
        check_value(key, value)?;
    }
    values.sort();
    values.dedup();
    Ok(values)
}

/// Whether kube-apiserver would take `key: value` as a label of an object
/// (it answers 422 to a create or update otherwise).
pub fn check_label(key: &str, value: &str) -> Result<(), SelectorError> {
    check_key(key)?;
    check_value(key, value)
}

/// A qualified name: `[prefix/]name`, the prefix a DNS subdomain of at most
/// 253 characters, the name at most 63 characters of `[A-Za-z0-9_.-]`
/// starting and ending alphanumeric.
fn check_key(key: &str) -> Result<(), SelectorError> {
    let problem = |problem: &str| SelectorError::Key {
        key: key.to_owned(),
        problem: problem.to_owned(),
    };
    let (prefix, name) = match key.split_once('/') {
        Some((prefix, name)) => (Some(prefix), name),
        None => (None, key),
    };
    if let Some(prefix) = prefix {
        let label_ok = |label: &str| {
            !label.is_empty()
                && label.len() <= 63
                && label
                    .bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !label.starts_with('-')
                && !label.ends_with('-')
        };
        if prefix.is_empty() || prefix.len() > 253 || !prefix.split('.').all(label_ok) {
            return Err(problem(
                "the prefix must be a DNS subdomain (lower-case alphanumerics, '-' and '.')",
            ));
        }
    }
    if name.is_empty() {
        return Err(problem("the name part must not be empty"));
    }
    name_part(name).map_err(|p| problem(&p))
}

/// A label value: empty, or at most 63 characters as a key's name part.
fn check_value(key: &str, value: &str) -> Result<(), SelectorError> {
    if value.is_empty() {
        return Ok(());
    }
    name_part(value).map_err(|problem| SelectorError::Value {
        key: key.to_owned(),
        value: value.to_owned(),
        problem,
    })
}

fn name_part(text: &str) -> Result<(), String> {
    let alphanumeric = |c: Option<char>| c.is_some_and(|c| c.is_ascii_alphanumeric());
    if text.len() > 63 {
        return Err("must be at most 63 characters".to_owned());
    }
    if !text
        .chars()
        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
        || !alphanumeric(text.chars().next())
        || !alphanumeric(text.chars().last())
    {
        return Err(
            "must be alphanumerics, '-', '_' or '.', starting and ending with an alphanumeric".to_owned(),
        );
    }
    Ok(())
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Token<'a> {
    Word(&'a str),
    Not,
    Equals,
    DoubleEquals,
    NotEquals,
    GreaterThan,
    LessThan,
    Open,
    Close,
    Comma,
    End,
}

impl Token<'_> {
    fn describe(self) -> String {
        match self {
            Token::Word(word) => format!("{word:?}"),
            Token::End => "the end".to_owned(),
            Token::Not => "'!'".to_owned(),
            Token::Equals => "'='".to_owned(),
            Token::DoubleEquals => "'=='".to_owned(),
            Token::NotEquals => "'!='".to_owned(),
            Token::GreaterThan => "'>'".to_owned(),
            Token::LessThan => "'<'".to_owned(),
            Token::Open => "'('".to_owned(),
            Token::Close => "')'".to_owned(),
            Token::Comma => "','".to_owned(),
        }
    }
}

/// Splits a selector into tokens; whitespace only separates.
struct Lexer<'a> {
    rest: &'a str,
}

impl<'a> Lexer<'a> {
    fn new(text: &'a str) -> Self {
        Lexer { rest: text }
    }

    fn peek(&self) -> Token<'a> {
        Lexer { rest: self.rest }.next()
    }

    fn next(&mut self) -> Token<'a> {
        self.rest = self.rest.trim_start();
        let symbols: [(&str, Token<'a>); 9] = [
            ("==", Token::DoubleEquals),
            ("!=", Token::NotEquals),
            ("=", Token::Equals),
            ("!", Token::Not),
            (">", Token::GreaterThan),
            ("<", Token::LessThan),
            ("(", Token::Open),
            (")", Token::Close),
            (",", Token::Comma),
        ];
        if self.rest.is_empty() {
            return Token::End;
        }
        for (symbol, token) in symbols {
            if let Some(rest) = self.rest.strip_prefix(symbol) {
                self.rest = rest;
                return token;
            }
        }
        let end = self
            .rest
            .find(|c: char| c.is_whitespace() || "=!<>(),".contains(c))
            .unwrap_or(self.rest.len());
        let (word, rest) = self.rest.split_at(end);
        self.rest = rest;
        Token::Word(word)
    }
}

/// A server's `--lease-label`: labels as `k=v[,k=v]` (spaces around keys
/// and values are dropped, as upstream's `ParseLabels` does), each one
/// kube-apiserver would take: a label it refuses would leave the server
/// without a Lease, renewal after renewal.
pub fn parse_labels(text: &str) -> Result<BTreeMap<String, String>, String> {
    let mut labels = BTreeMap::new();
    for pair in text.split(',').filter(|p| !p.is_empty()) {
        let (key, value) = pair
            .split_once('=')
            .ok_or_else(|| format!("label {pair:?} is not key=value"))?;
        let (key, value) = (key.trim(), value.trim());
        check_label(key, value).map_err(|e| e.to_string())?;
        labels.insert(key.to_owned(), value.to_owned());
    }
    Ok(labels)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn label_lists() {
        assert!(parse_labels("k8s-app=konnectivity-server").is_ok());
        assert!(parse_labels("a=b,c=d").is_ok());
        assert!(parse_labels("novalue").is_err());
        assert!(parse_labels("a b=c").is_err());
        let spaced = parse_labels(" key = value , example.com/tier = x ").unwrap();
        assert_eq!(
            spaced,
            BTreeMap::from([
                ("key".into(), "value".into()),
                ("example.com/tier".into(), "x".into())
            ])
        );
        for bad in ["-x=y", "a=b/c", "Example.com/x=y", "a=b=c"] {
            let error = parse_labels(bad).unwrap_err();
            assert!(error.starts_with("invalid "), "{bad}: {error}");
        }
    }

    fn normal(text: &str) -> String {
        LabelSelector::parse(text)
            .unwrap_or_else(|e| panic!("{text:?}: {e}"))
            .to_string()
    }

    #[test]
    fn selectors_read_as_apimachinery_reads_them_and_print_sorted_by_key() {
        assert_eq!(
            normal("k8s-app=konnectivity-server"),
            "k8s-app=konnectivity-server"
        );
        assert_eq!(normal(" tier != canary , app == x "), "app==x,tier!=canary");
        assert_eq!(
            normal("env notin (prod, dev,prod),app in (a)"),
            "app in (a),env notin (dev,prod)"
        );
        assert_eq!(normal("!canary,app"), "app,!canary");
        assert_eq!(
            normal("example.com/zone=a,gen>3,gen<10"),
            "example.com/zone=a,gen>3,gen<10"
        );
        assert_eq!(normal("a=,b in (x,)"), "a=,b in (,x)");
        assert_eq!(normal(""), "");
        assert!(LabelSelector::parse("  ").unwrap().is_everything());
        assert!(!LabelSelector::parse("a").unwrap().is_everything());
    }

    #[test]
    fn bad_selectors_are_refused_saying_what_is_wrong() {
        let error = |text: &str| LabelSelector::parse(text).unwrap_err().to_string();
        assert!(error("*notavalidlabel*").contains("invalid label key \"*notavalidlabel*\""));
        assert!(
            error("a=b,").contains("the end where a label key was expected"),
            "{}",
            error("a=b,")
        );
        assert!(error("a in (b").contains("the end in the values of \"a\""));
        assert!(error("a in ()").contains("must not be empty"));
        assert!(error("a in b").contains("expected a parenthesised list"));
        assert!(error("a b").contains("\"b\" after key \"a\""));
        assert!(error("a=b c").contains("expected a comma"));
        assert!(error("a>x").contains("integer"));
        assert!(error("a=-b").contains("invalid value \"-b\""));
        assert!(error("Example.com/a=b").contains("DNS subdomain"));
        assert!(error(&format!("a={}", "v".repeat(64))).contains("at most 63"));
        assert!(error("a=b=c").contains("'=' after the term \"a=b\""));
    }
}
