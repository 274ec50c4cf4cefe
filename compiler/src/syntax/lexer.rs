//! The lexer: `.cell` text to tokens, with logos.
//!
//! It never aborts (as rust-analyzer's `lexed_str`): a character that starts
//! no token becomes a [`Token::Error`] token, a malformed number a
//! [`Token::MalformedNumber`], each with a diagnostic, and lexing goes on.
//! The parser skips error tokens and reads a malformed number as an operand
//! whose value is unknown, so one typo yields one message. [`lex_tokens`]
//! hands the diagnostics back per token, so that the parser can drop the
//! ones inside text it skips while recovering from an earlier error.

use crate::diag::{Diagnostic, Diagnostics, FileId, Span};
use logos::Logos;

/// What the lexer could not read.
#[derive(Clone, Debug, Default, PartialEq)]
pub enum LexError {
    /// A character that starts no token, such as `$` or `#`.
    #[default]
    UnknownCharacter,
}

/// A token of the `.cell` language. Whitespace and `//` comments are skipped.
#[derive(Logos, Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[logos(skip r"[ \t\r\n\f]+")]
#[logos(skip(r"//[^\n]*", allow_greedy = true))]
#[logos(error = LexError)]
pub enum Token {
    /// The keyword `cell`.
    #[token("cell")]
    Cell,
    /// The keyword `fn`.
    #[token("fn")]
    Fn,
    /// The keyword `const`.
    #[token("const")]
    Const,
    /// The keyword `let`.
    #[token("let")]
    Let,
    /// The keyword `input`.
    #[token("input")]
    Input,
    /// The keyword `state`.
    #[token("state")]
    State,
    /// The keyword `param`.
    #[token("param")]
    Param,
    /// The keyword `rate`.
    #[token("rate")]
    Rate,
    /// The keyword `output`.
    #[token("output")]
    Output,
    /// A name, `[A-Za-z_][A-Za-z0-9_]*`, that is not a keyword.
    #[regex(r"[A-Za-z_][A-Za-z0-9_]*")]
    Ident,
    /// A number: `12`, `0.5`, `1e-5`, `2.5E+3`.
    #[regex(r"[0-9]+(\.[0-9]+)?([eE][+-]?[0-9]+)?")]
    Number,
    /// `1.`, `1e`, `1e+`, `2.5E`: a number that stops half way; `.5`: one
    /// without its leading digit.
    #[regex(r"[0-9]+\.([eE][+-]?)?", priority = 1)]
    #[regex(r"[0-9]+(\.[0-9]+)?[eE][+-]?")]
    #[regex(r"\.[0-9]+([eE][+-]?[0-9]*)?")]
    MalformedNumber,
    /// `'`, as in `h'`.
    #[token("'")]
    Prime,
    /// `{`.
    #[token("{")]
    LBrace,
    /// `}`.
    #[token("}")]
    RBrace,
    /// `(`.
    #[token("(")]
    LParen,
    /// `)`.
    #[token(")")]
    RParen,
    /// `[`.
    #[token("[")]
    LBracket,
    /// `]`.
    #[token("]")]
    RBracket,
    /// `,`.
    #[token(",")]
    Comma,
    /// `=`.
    #[token("=")]
    Eq,
    /// `+`.
    #[token("+")]
    Plus,
    /// `-`.
    #[token("-")]
    Minus,
    /// `*`.
    #[token("*")]
    Star,
    /// `/`.
    #[token("/")]
    Slash,
    /// `@`, the matrix-vector product.
    #[token("@")]
    At,
    /// `==`.
    #[token("==")]
    EqEq,
    /// `!=`.
    #[token("!=")]
    NotEq,
    /// `<`.
    #[token("<")]
    Less,
    /// `<=`.
    #[token("<=")]
    LessEq,
    /// `>`.
    #[token(">")]
    Greater,
    /// `>=`.
    #[token(">=")]
    GreaterEq,
    /// `;`, which may end a statement.
    #[token(";")]
    Semi,
    /// Anything the lexer could not read (already reported).
    Error,
    /// End of input (synthesised by [`lex`]).
    Eof,
}

impl Token {
    /// How the token is named in "expected ..." messages.
    pub fn describe(self) -> &'static str {
        match self {
            Token::Cell => "`cell`",
            Token::Fn => "`fn`",
            Token::Const => "`const`",
            Token::Let => "`let`",
            Token::Input => "`input`",
            Token::State => "`state`",
            Token::Param => "`param`",
            Token::Rate => "`rate`",
            Token::Output => "`output`",
            Token::Ident => "a name",
            Token::Number | Token::MalformedNumber => "a number",
            Token::Prime => "`'`",
            Token::LBrace => "`{`",
            Token::RBrace => "`}`",
            Token::LParen => "`(`",
            Token::RParen => "`)`",
            Token::LBracket => "`[`",
            Token::RBracket => "`]`",
            Token::Comma => "`,`",
            Token::Eq => "`=`",
            Token::Plus => "`+`",
            Token::Minus => "`-`",
            Token::Star => "`*`",
            Token::Slash => "`/`",
            Token::At => "`@`",
            Token::EqEq => "`==`",
            Token::NotEq => "`!=`",
            Token::Less => "`<`",
            Token::LessEq => "`<=`",
            Token::Greater => "`>`",
            Token::GreaterEq => "`>=`",
            Token::Semi => "`;`",
            Token::Error => "an unreadable character",
            Token::Eof => "end of file",
        }
    }

    /// Whether the token is one of the keywords `cell fn const let input state param rate output`.
    pub fn is_keyword(self) -> bool {
        matches!(
            self,
            Token::Cell
                | Token::Fn
                | Token::Const
                | Token::Let
                | Token::Input
                | Token::State
                | Token::Param
                | Token::Rate
                | Token::Output
        )
    }
}

/// A token with its span.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lexeme {
    /// Which token it is.
    pub token: Token,
    /// Where its text is in the source.
    pub span: Span,
}

/// Splits `source` into tokens, ending with one [`Token::Eof`], and
/// records a diagnostic for every token it could not read.
pub fn lex(file: FileId, source: &str, diags: &mut Diagnostics) -> Vec<Lexeme> {
    let (tokens, errors) = lex_tokens(file, source);
    for (_, d) in errors {
        diags.push(d);
    }
    tokens
}

/// As [`lex`], with each diagnostic paired with the index of its token.
pub fn lex_tokens(file: FileId, source: &str) -> (Vec<Lexeme>, Vec<(usize, Diagnostic)>) {
    let mut out = Vec::new();
    let mut errors = Vec::new();
    let mut lexer = Token::lexer(source);
    while let Some(result) = lexer.next() {
        let span = Span::new(file, lexer.span());
        let token = match result {
            Ok(Token::MalformedNumber) => {
                errors.push((out.len(), malformed_number(span, lexer.slice())));
                Token::MalformedNumber
            }
            Ok(t) => t,
            Err(LexError::UnknownCharacter) => {
                let c = lexer.slice().chars().next().unwrap_or('?');
                let mut d = Diagnostic::error(span, format!("unexpected character `{}`", c.escape_default()))
                    .with_label("not part of the language");
                match c {
                    '#' => d = d.with_note("comments start with `//`"),
                    '^' => d = d.with_note("there is no power operator: write `x * x`, or `exp(p * log(x))`"),
                    _ => {}
                }
                errors.push((out.len(), d));
                Token::Error
            }
        };
        out.push(Lexeme { token, span });
    }
    let end = source.len();
    out.push(Lexeme { token: Token::Eof, span: Span::new(file, end..end) });
    (out, errors)
}

/// The diagnostic for a [`Token::MalformedNumber`], saying what is missing.
fn malformed_number(span: Span, text: &str) -> Diagnostic {
    let d = Diagnostic::error(span, format!("malformed number `{text}`"));
    let d = if text.starts_with('.') {
        d.with_label(format!("write `0{text}`")).with_note("a number needs a digit before its `.`")
    } else if text.ends_with('.') {
        d.with_label(format!("write `{text}0` or `{}`", text.trim_end_matches('.')))
            .with_note("digits must follow the `.`")
    } else {
        d.with_label("the exponent has no digits")
            .with_note("an exponent is written with digits, as in `1e-5` or `2.5E+3`")
    };
    d
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(src: &str) -> Vec<Token> {
        let mut d = Diagnostics::default();
        lex(FileId(0), src, &mut d).into_iter().map(|l| l.token).collect()
    }

    #[test]
    fn numbers_and_primes() {
        use Token::*;
        assert_eq!(kinds("c' = 1e-5 * 2.5E+3 // hi"), vec![Ident, Prime, Eq, Number, Star, Number, Eof]);
        assert_eq!(kinds("12 0.5"), vec![Number, Number, Eof]);
    }

    #[test]
    fn malformed_and_unknown_recover() {
        use Token::*;
        let mut d = Diagnostics::default();
        let toks: Vec<_> = lex(FileId(0), "1. $ x 3e .5", &mut d).into_iter().map(|l| l.token).collect();
        assert_eq!(toks, vec![MalformedNumber, Error, Ident, MalformedNumber, MalformedNumber, Eof]);
        assert_eq!(d.error_count(), 4);
    }

    #[test]
    fn keywords_are_not_identifiers() {
        use Token::*;
        assert_eq!(kinds("cell cells letx let"), vec![Cell, Ident, Ident, Let, Eof]);
    }
}
