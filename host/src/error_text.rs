//! One line for an error and its causes, as the CLI prints it and the API
//! answers it. Many of this crate's errors already quote their cause in their
//! message (`cannot read {path}: {source}`); a cause is added only when the
//! text so far does not already say it.

use std::error::Error;

/// `outer: cause: cause`, each cause once.
pub fn chain_text<'a>(chain: impl IntoIterator<Item = &'a (dyn Error + 'static)>) -> String {
    let mut text = String::new();
    for err in chain {
        let message = err.to_string();
        if text.is_empty() {
            text = message;
        } else if !message.is_empty() && !text.contains(&message) {
            text.push_str(": ");
            text.push_str(&message);
        }
    }
    text
}

/// [`chain_text`] of `err` and its sources.
pub fn error_text(err: &(dyn Error + 'static)) -> String {
    chain_text(std::iter::successors(Some(err), |e: &&(dyn Error + 'static)| (*e).source()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    enum Outer {
        #[error("cannot read {path}: {source}")]
        Quoting { path: String, source: std::io::Error },
        #[error("cannot load")]
        Silent(#[source] std::io::Error),
    }

    #[test]
    fn a_cause_the_message_quotes_is_said_once_and_a_silent_one_is_added() {
        let missing = || std::io::Error::new(std::io::ErrorKind::NotFound, "no such file");
        let quoting = Outer::Quoting { path: "/x".into(), source: missing() };
        assert_eq!(error_text(&quoting), "cannot read /x: no such file");
        assert_eq!(error_text(&Outer::Silent(missing())), "cannot load: no such file");
        let wrapped = anyhow::Error::new(quoting).context("cannot swap");
        assert_eq!(chain_text(wrapped.chain()), "cannot swap: cannot read /x: no such file");
    }
}
