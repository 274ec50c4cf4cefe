//! Syntax: the `.cell` text as written — tokens, the AST, and the parser.
//!
//! Nothing here knows about sizes or types; that is [`crate::lower`]'s job.

pub mod ast;
pub mod lexer;
pub mod parser;

pub use parser::parse;
