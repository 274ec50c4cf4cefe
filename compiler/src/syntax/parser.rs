//! The parser: tokens to [`ast::File`](crate::syntax::ast::File), by recursive descent.
//!
//! It reports as many errors as it can in one pass: after a bad statement
//! it skips to the next place a statement can start (`let`, `output`,
//! `name'`, `}`) and goes on. What it skips is not reported again: the
//! lexer's errors inside skipped text are dropped, and an error right after
//! an unreadable character is taken to be caused by it. What it could read
//! of a broken statement is kept — the names a `let` binds, the state an
//! update assigns — with [`ExprKind::Error`] for the rest, so that later
//! passes do not report the missing parts again. Nesting is bounded
//! ([`MAX_DEPTH`]) so that no input, however deep, can overflow the stack
//! here or in the passes that walk the tree afterwards.

use super::ast::*;
use super::lexer::{lex_tokens, Lexeme, Token};
use crate::diag::{Diagnostic, Diagnostics, FileId, Span};
use std::collections::{HashMap, HashSet};

/// Deepest nesting of parentheses, calls and unary minuses the parser reads.
pub const MAX_DEPTH: u32 = 200;

/// Deepest expression or dimension tree the parser builds: a left-associated
/// chain (`a + b + c ...`) is as deep as it is long, but only nesting counts
/// toward [`MAX_DEPTH`]; the passes that walk the tree grow their stack as
/// they need (`stacker`), so this bounds only the work, generously.
pub const MAX_TREE_DEPTH: u32 = 20_000;

/// Parses one file. The AST is returned even when there are errors, with
/// the broken parts left out or replaced by [`ExprKind::Error`].
pub fn parse(file: FileId, source: &str) -> (File, Diagnostics) {
    let (tokens, lex_errors) = lex_tokens(file, source);
    let mut p = Parser {
        tokens,
        pos: 0,
        source,
        diags: Diagnostics::default(),
        depth_reported: false,
        lex_errors: lex_errors.into_iter().collect(),
        recovering: false,
        last_lex_error: None,
        keyword_names: HashSet::new(),
        list_continues: false,
    };
    let ast = p.file();
    (ast, p.diags)
}

struct Parser<'s> {
    tokens: Vec<Lexeme>,
    pos: usize,
    source: &'s str,
    diags: Diagnostics,
    depth_reported: bool,
    /// The lexer's diagnostics by token index, reported when the parser
    /// reaches the token (and dropped if it is skipped while recovering).
    lex_errors: HashMap<usize, Diagnostic>,
    /// Skipping a broken statement: lexer errors met are not reported.
    recovering: bool,
    /// Index of the last token whose lexer error was reported.
    last_lex_error: Option<usize>,
    /// Keywords a `let` tried to bind (already reported): later reads of
    /// them are taken as names rather than reported again.
    keyword_names: HashSet<String>,
    /// A declaration list goes on without its `,`: the previous variable
    /// lacked its `]` and the next one was already found.
    list_continues: bool,
}

/// The parse failed here; the error is already reported.
struct Failed;

type PResult<T> = Result<T, Failed>;

impl Parser<'_> {
    // ---- token access -------------------------------------------------

    /// The current token, skipping error tokens (reporting the lexer's
    /// diagnostic for each, unless recovering).
    fn peek(&mut self) -> Lexeme {
        while self.tokens[self.pos].token == Token::Error {
            self.pass(self.pos);
            self.pos += 1;
        }
        self.tokens[self.pos]
    }

    /// The parser moves past token `i`: its lexer error, if any, is now due.
    fn pass(&mut self, i: usize) {
        if let Some(d) = self.lex_errors.remove(&i) {
            if !self.recovering {
                self.diags.push(d);
                self.last_lex_error = Some(i);
            }
        }
    }

    /// Whether token `i` is the first on its line.
    fn starts_line(&self, i: usize) -> bool {
        let Some(prev) = i.checked_sub(1).map(|p| self.tokens[p].span) else { return true };
        let cur = self.tokens[i].span;
        self.source.get(prev.end as usize..cur.start as usize).is_some_and(|gap| gap.contains('\n'))
    }

    /// Whether the current token directly follows an unreadable character
    /// that was reported: an error here is a consequence of it.
    fn after_unreadable(&mut self) -> bool {
        self.peek();
        self.pos > 0
            && self.last_lex_error == Some(self.pos - 1)
            && self.tokens[self.pos - 1].token == Token::Error
    }

    fn peek_token(&mut self) -> Token {
        self.peek().token
    }

    /// The token after the current one.
    fn peek2(&mut self) -> Lexeme {
        self.peek_nth(1)
    }

    /// The `n`th token after the current one (error tokens skipped).
    fn peek_nth(&mut self, n: usize) -> Lexeme {
        self.peek();
        let last = self.tokens.len() - 1;
        let mut i = self.pos;
        for _ in 0..n {
            i = (i + 1).min(last);
            while i < last && self.tokens[i].token == Token::Error {
                i += 1;
            }
        }
        self.tokens[i]
    }

    fn bump(&mut self) -> Lexeme {
        let l = self.peek();
        if l.token != Token::Eof {
            self.pass(self.pos);
            self.pos += 1;
        }
        l
    }

    fn eat(&mut self, t: Token) -> Option<Lexeme> {
        if self.peek_token() == t {
            Some(self.bump())
        } else {
            None
        }
    }

    fn text(&self, span: Span) -> &str {
        self.source.get(span.range()).unwrap_or("")
    }

    /// Describes the current token for an "expected X, found Y" message.
    fn found(&mut self) -> String {
        let l = self.peek();
        match l.token {
            Token::Ident | Token::Number => format!("`{}`", self.text(l.span)),
            t => t.describe().to_string(),
        }
    }

    fn expected(&mut self, what: &str) -> Failed {
        if self.after_unreadable() {
            return Failed;
        }
        let l = self.peek();
        let found = self.found();
        self.diags.push(
            Diagnostic::error(l.span, format!("expected {what}, found {found}"))
                .with_label(format!("expected {what}")),
        );
        Failed
    }

    fn expect(&mut self, t: Token) -> PResult<Lexeme> {
        match self.eat(t) {
            Some(l) => Ok(l),
            None => Err(self.expected(t.describe())),
        }
    }

    fn ident(&mut self, what: &str) -> PResult<Ident> {
        let l = self.peek();
        match l.token {
            Token::Ident => {
                self.bump();
                Ok(Ident { name: self.text(l.span).to_string(), span: l.span })
            }
            t if t.is_keyword() => {
                let word = self.text(l.span).to_string();
                self.diags.push(
                    Diagnostic::error(l.span, format!("expected {what}, found keyword `{word}`"))
                        .with_label("keywords cannot be used as names"),
                );
                Err(Failed)
            }
            _ => Err(self.expected(what)),
        }
    }

    // ---- recovery -------------------------------------------------------

    /// Runs a recovery step: the tokens it skips report nothing.
    fn silently(&mut self, skip: impl FnOnce(&mut Self)) {
        let was = std::mem::replace(&mut self.recovering, true);
        skip(self);
        self.recovering = was;
    }

    /// Skips to where the next item (`cell`, `fn`, `const`) starts.
    fn recover_to_item(&mut self) {
        self.silently(Self::skip_to_item);
    }

    fn skip_to_item(&mut self) {
        loop {
            match self.peek_token() {
                Token::Cell | Token::Fn | Token::Const | Token::Eof => return,
                _ => {
                    self.bump();
                }
            }
        }
    }

    /// Skips to where the next statement of a block can start, or to the
    /// block's closing brace. Nested brackets are skipped whole.
    fn recover_to_stmt(&mut self) {
        self.silently(Self::skip_to_stmt);
    }

    fn skip_to_stmt(&mut self) {
        let mut nesting = 0usize;
        loop {
            let t = self.peek_token();
            match t {
                Token::Eof => return,
                Token::LParen | Token::LBracket | Token::LBrace => nesting += 1,
                Token::RParen | Token::RBracket => nesting = nesting.saturating_sub(1),
                Token::RBrace if nesting == 0 => return,
                Token::RBrace => nesting -= 1,
                _ if nesting > 0 => {}
                Token::Let | Token::Output | Token::Input | Token::State | Token::Param | Token::Rate => {
                    return
                }
                Token::Cell | Token::Fn | Token::Const => return,
                Token::Semi => {
                    self.bump();
                    return;
                }
                Token::Ident if self.peek2().token == Token::Prime && self.peek_nth(2).token == Token::Eq => {
                    return
                }
                // `c = ...` on a line of its own: a broken statement (reported when reached).
                Token::Ident if self.peek2().token == Token::Eq && self.starts_line(self.pos) => return,
                _ => {}
            }
            self.bump();
        }
    }

    /// Skips a balanced `( ... )` if one starts here.
    fn skip_parens(&mut self) {
        if self.peek_token() != Token::LParen {
            return;
        }
        self.silently(|p| {
            let mut nesting = 0usize;
            loop {
                match p.bump().token {
                    Token::Eof => return,
                    Token::LParen => nesting += 1,
                    Token::RParen if nesting <= 1 => return,
                    Token::RParen => nesting -= 1,
                    _ => {}
                }
            }
        });
    }

    /// After a too-deep nesting: skips the rest of the innermost bracket.
    fn skip_rest_of_group(&mut self) {
        self.silently(Self::skip_group_tail);
    }

    fn skip_group_tail(&mut self) {
        let mut nesting = 0usize;
        loop {
            match self.peek_token() {
                Token::Eof => return,
                Token::LParen | Token::LBracket => nesting += 1,
                Token::RParen | Token::RBracket | Token::RBrace if nesting == 0 => return,
                Token::RParen | Token::RBracket => nesting -= 1,
                Token::Let | Token::Output | Token::Cell | Token::Fn | Token::Const if nesting == 0 => return,
                _ => {}
            }
            self.bump();
        }
    }

    fn too_long(&mut self, span: Span) -> Failed {
        let message = format!("expression is too long (more than {MAX_TREE_DEPTH} operations in a row)");
        self.limit_reached(span, message, "length limit reached here")
    }

    fn too_deep(&mut self, span: Span) -> Failed {
        let message = format!("expression is nested too deeply (more than {MAX_DEPTH} levels)");
        self.limit_reached(span, message, "nesting limit reached here")
    }

    /// Reports an expression past one of the parser's limits (once per file) and skips the rest
    /// of its group.
    fn limit_reached(&mut self, span: Span, message: String, label: &str) -> Failed {
        if !self.depth_reported {
            self.depth_reported = true;
            self.diags.push(
                Diagnostic::error(span, message).with_label(label).with_note("split it into several `let`s"),
            );
        }
        self.skip_rest_of_group();
        Failed
    }

    // ---- items ----------------------------------------------------------

    fn file(&mut self) -> File {
        let mut items = Vec::new();
        loop {
            let result = match self.peek_token() {
                Token::Eof => break,
                Token::Cell => self.cell().map(Item::Cell),
                Token::Fn => self.function().map(Item::Fn),
                Token::Const => self.constant().map(Item::Const),
                _ => {
                    if !self.after_unreadable() {
                        let d = self.top_level_error();
                        self.diags.push(d);
                    }
                    self.bump();
                    Err(Failed)
                }
            };
            match result {
                Ok(item) => items.push(item),
                Err(Failed) => self.recover_to_item(),
            }
        }
        File { items }
    }

    /// Something other than an item at the top level of the file.
    fn top_level_error(&mut self) -> Diagnostic {
        let l = self.peek();
        let found = self.found();
        let d = Diagnostic::error(l.span, format!("expected `cell`, `fn` or `const`, found {found}"));
        match l.token {
            Token::RBrace => d
                .with_label("this `}` closes nothing")
                .with_note("is there one `}` too many above?"),
            Token::Let => d
                .with_label("not allowed at the top level of a file")
                .with_note("`let` belongs inside a cell or a function; a file-level constant is written `const NAME = 0.5`"),
            Token::Input | Token::State | Token::Param | Token::Rate | Token::Output => d
                .with_label("not allowed at the top level of a file")
                .with_note("declarations and statements belong inside `cell NAME { ... }`"),
            _ => d.with_label("not allowed at the top level of a file"),
        }
    }

    fn constant(&mut self) -> PResult<ConstDef> {
        let kw = self.expect(Token::Const)?;
        let name = self.ident("a constant name")?;
        self.expect(Token::Eq)?;
        let neg = self.eat(Token::Minus).is_some();
        let l = self.peek();
        if l.token != Token::Number {
            return Err(self.expected("a number (a `const` is a scalar literal)"));
        }
        self.bump();
        let value = self.number_value(l.span)?;
        self.eat(Token::Semi);
        Ok(ConstDef { name, value: if neg { -value } else { value }, span: kw.span.to(l.span) })
    }

    fn function(&mut self) -> PResult<FnDef> {
        let errors_before = self.diags.error_count();
        let kw = self.expect(Token::Fn)?;
        let name = self.ident("a function name")?;
        self.expect(Token::LParen)?;
        let mut params = Vec::new();
        if self.peek_token() != Token::RParen {
            loop {
                params.push(self.ident("a parameter name")?);
                if self.eat(Token::Comma).is_none() {
                    break;
                }
            }
        }
        self.expect(Token::RParen)?;
        let open = self.expect(Token::LBrace)?;
        let mut lets = Vec::new();
        let mut result = None;
        loop {
            let start = self.pos;
            match self.peek_token() {
                Token::Semi => {
                    self.bump();
                }
                Token::Let => match self.let_stmt() {
                    Ok(l) => {
                        if let Some(r) = result.take() {
                            self.diags.push(late_result(&r));
                        }
                        lets.push(l)
                    }
                    Err(Failed) => self.recover_to_stmt(),
                },
                Token::RBrace => break,
                Token::Eof => return Err(self.unclosed(open.span, "function body")),
                Token::Cell | Token::Fn | Token::Const => {
                    let l = self.peek();
                    self.diags.push(
                        Diagnostic::error(l.span, format!("expected `}}` to close function `{}`", name.name))
                            .with_label("a new item starts here")
                            .with_secondary(open.span, "unclosed `{` opened here"),
                    );
                    return Err(Failed);
                }
                Token::Output | Token::Input | Token::State | Token::Param | Token::Rate => {
                    let l = self.peek();
                    let word = self.text(l.span).to_string();
                    self.diags.push(
                        Diagnostic::error(l.span, format!("`{word}` is not allowed in a function body"))
                            .with_note("a `fn` body is `let`s followed by one expression, its result"),
                    );
                    self.bump();
                    self.recover_to_stmt();
                }
                Token::Ident if self.peek2().token == Token::Prime => {
                    let l = self.peek();
                    self.diags.push(
                        Diagnostic::error(l.span, "state updates are not allowed in a function body")
                            .with_note("a `fn` is pure: it takes values and returns one"),
                    );
                    self.bump();
                    self.recover_to_stmt();
                }
                _ => match self.expr() {
                    Ok(e) => {
                        if let Some(r) = result.replace(e) {
                            self.diags.push(late_result(&r));
                        }
                    }
                    Err(Failed) => self.recover_to_stmt(),
                },
            }
            // Every error path above consumes a token or stops at one that
            // starts a statement; make sure of progress regardless.
            if self.pos == start && !matches!(self.peek_token(), Token::Let | Token::RBrace | Token::Eof) {
                self.bump();
            }
        }
        let close = self.expect(Token::RBrace)?;
        let span = kw.span.to(close.span);
        let result = result.unwrap_or_else(|| {
            let mut d =
                Diagnostic::error(close.span, format!("function `{}` has no result expression", name.name))
                    .with_label("expected an expression before `}`");
            d = match lets.last().map(|l: &Let| l.names.as_slice()) {
                Some([last]) => d.with_note(format!(
                    "a `fn` body ends with the expression it returns: to return `{0}`, write `{0}` before `}}`",
                    last.name
                )),
                _ => d.with_note("a `fn` body ends with the expression it returns"),
            };
            self.diags.push(d);
            // Keep the function, so that its calls are not reported as unknown.
            Expr::error(close.span)
        });
        let recovered = self.diags.error_count() > errors_before;
        Ok(FnDef { name, params, lets, result, span, recovered })
    }

    fn unclosed(&mut self, open: Span, what: &str) -> Failed {
        let eof = self.peek().span;
        self.diags.push(
            Diagnostic::error(eof, format!("unexpected end of file in {what}"))
                .with_label("expected `}`")
                .with_secondary(open, "unclosed `{` opened here"),
        );
        Failed
    }

    fn cell(&mut self) -> PResult<CellDef> {
        let errors_before = self.diags.error_count();
        let kw = self.expect(Token::Cell)?;
        let name = self.ident("a cell name")?;
        let open = self.expect(Token::LBrace)?;
        let mut decls = Vec::new();
        let mut rates = Vec::new();
        let mut stmts: Vec<Stmt> = Vec::new();
        loop {
            let l = self.peek();
            let result = match l.token {
                Token::Semi => {
                    self.bump();
                    Ok(())
                }
                Token::RBrace => break,
                Token::Eof => return Err(self.unclosed(open.span, &format!("cell `{}`", name.name))),
                Token::Cell | Token::Fn | Token::Const => {
                    // A missing `}`: report it and let the item loop take the next item.
                    self.diags.push(
                        Diagnostic::error(l.span, format!("expected `}}` to close cell `{}`", name.name))
                            .with_label("a new item starts here")
                            .with_secondary(open.span, "unclosed `{` opened here"),
                    );
                    let span = kw.span.to(l.span);
                    return Ok(CellDef { span, name, decls, rates, stmts, recovered: true });
                }
                Token::Input | Token::State | Token::Param => {
                    let first_stmt = stmts.first().map(stmt_span);
                    self.decl_line().map(|vars| {
                        self.declared_after(first_stmt, vars.first().map(|v| v.span));
                        decls.extend(vars)
                    })
                }
                Token::Rate => {
                    let first_stmt = stmts.first().map(stmt_span);
                    self.rate_line().map(|line| {
                        self.declared_after(first_stmt, line.first().map(|r| r.span));
                        rates.extend(line)
                    })
                }
                Token::Let => self.let_stmt().map(|l| stmts.push(Stmt::Let(l))),
                Token::Output => self.output_stmt().map(|s| stmts.push(s)),
                Token::Ident if self.peek2().token == Token::Prime => {
                    self.assign_stmt().map(|s| stmts.push(s))
                }
                Token::Ident if self.peek2().token == Token::Eq => {
                    self.bare_assignment(&decls, &stmts).map(|s| stmts.extend(s))
                }
                Token::RParen | Token::RBracket if !self.after_unreadable() => {
                    let word = self.text(l.span).to_string();
                    self.diags.push(
                        Diagnostic::error(l.span, format!("unmatched `{word}`"))
                            .with_label(format!("this `{word}` closes nothing")),
                    );
                    Err(Failed)
                }
                _ => Err(self.expected("a declaration or a statement (`let`, `NAME' =`, `output`)")),
            };
            if result.is_err() {
                self.recover_to_stmt();
                // A stray token that recovery does not move past.
                if self.pos < self.tokens.len() && self.peek_token() == l.token && self.peek().span == l.span
                {
                    self.bump();
                }
            }
        }
        let close = self.expect(Token::RBrace)?;
        let recovered = self.diags.error_count() > errors_before;
        Ok(CellDef { span: kw.span.to(close.span), name, decls, rates, stmts, recovered })
    }

    // ---- declarations ---------------------------------------------------

    fn decl_line(&mut self) -> PResult<Vec<VarDecl>> {
        let kw = self.bump();
        let kind = match kw.token {
            Token::Input => DeclKind::Input,
            Token::State => DeclKind::State,
            _ => DeclKind::Param,
        };
        let mut vars = Vec::new();
        loop {
            match self.var_decl(kind) {
                Ok(v) => vars.push(v),
                // No name to keep (a broken size keeps it, see `var_decl`).
                Err(Failed) => self.skip_rest_of_decl(0),
            }
            if std::mem::take(&mut self.list_continues) {
                continue;
            }
            if self.eat(Token::Comma).is_none() {
                break;
            }
        }
        Ok(vars)
    }

    /// Reports a declaration (at `decl`) made after the cell's first statement (at `first_stmt`).
    fn declared_after(&mut self, first_stmt: Option<Span>, decl: Option<Span>) {
        if let (Some(stmt), Some(decl)) = (first_stmt, decl) {
            self.diags.push(
                Diagnostic::error(decl, "declarations must come before statements")
                    .with_secondary(stmt, "first statement is here")
                    .with_note("move the declaration to the top of the cell"),
            );
        }
    }

    /// `rate NAME = number (, NAME = number)*`: each rate with its default.
    fn rate_line(&mut self) -> PResult<Vec<RateDecl>> {
        self.bump();
        let mut rates = Vec::new();
        loop {
            let name = self.ident("a name for the rate")?;
            if self.eat(Token::Eq).is_none() {
                let found = self.found();
                let l = self.peek();
                self.diags.push(
                    Diagnostic::error(
                        l.span,
                        format!("expected `=` and the default of `{}`, found {found}", name.name),
                    )
                    .with_label("expected `=`")
                    .with_note(format!("every rate has a default, as in `rate {} = 0.1`", name.name)),
                );
                return Err(Failed);
            }
            let l = self.peek();
            if l.token != Token::Number {
                return Err(self.expected("a number: the rate's default, in [0, 1)"));
            }
            self.bump();
            let value = self.number_value(l.span)?;
            rates.push(RateDecl { span: name.span.to(l.span), name, default: (value, l.span) });
            if self.eat(Token::Comma).is_none() {
                break;
            }
        }
        Ok(rates)
    }

    /// `NAME[dims] (= init)?`. Once the name is read the variable is
    /// returned even if its size is broken (with no dims), so that its
    /// uses are not reported as unknown names.
    fn var_decl(&mut self, kind: DeclKind) -> PResult<VarDecl> {
        let name = self.ident(&format!("a name for the {}", kind.word()))?;
        if self.peek_token() != Token::LBracket {
            if !self.after_unreadable() {
                let found = self.found();
                let l = self.peek();
                self.diags.push(
                    Diagnostic::error(
                        l.span,
                        format!("expected `[` with the size of `{}`, found {found}", name.name),
                    )
                    .with_label("expected `[`")
                    .with_note(format!(
                        "every {} has a size, as in `{}[H]`",
                        kind.word(),
                        name.name
                    )),
                );
            }
            return Ok(self.broken_decl(kind, name, 0));
        }
        self.bump();
        let Ok(dims) = self.dims(&name) else {
            return Ok(self.broken_decl(kind, name, 1));
        };
        let span = name.span.to(self.tokens[self.pos.saturating_sub(1)].span);
        let init = if self.eat(Token::Eq).is_some() { self.init() } else { None };
        Ok(VarDecl { kind, name, dims, init, span })
    }

    /// The dims of `name[`, through the closing `]`. A missing `]` at the
    /// end of the line, or before the next variable of a list, is
    /// reported and the dims are kept.
    fn dims(&mut self, name: &Ident) -> PResult<Vec<DimExpr>> {
        let mut dims = vec![self.dim(0)?];
        let missing = |dims: &[DimExpr], found: String| {
            let last = dims.last().map_or(name.span, DimExpr::span);
            Diagnostic::error(
                last,
                format!("expected `]` to close the size of `{}`, found {found}", name.name),
            )
            .with_label("expected `]` after this")
        };
        while self.eat(Token::Comma).is_some() {
            if self.peek_token() == Token::Ident && self.peek2().token == Token::LBracket {
                // `w[H, I, u[H, H]`: the next variable starts.
                let found = format!("the next variable, {}", self.found());
                let d = missing(&dims, found);
                self.diags.push(d);
                self.list_continues = true;
                return Ok(dims);
            }
            dims.push(self.dim(0)?);
        }
        if self.eat(Token::RBracket).is_some() {
            return Ok(dims);
        }
        let line_ends = matches!(
            self.peek_token(),
            Token::Input
                | Token::State
                | Token::Param
                | Token::Let
                | Token::Output
                | Token::RBrace
                | Token::Eof
                | Token::Eq
                | Token::Cell
                | Token::Fn
                | Token::Const
        ) || (self.peek_token() == Token::Ident && self.peek2().token == Token::Prime);
        if self.after_unreadable() {
            return Err(Failed);
        }
        let found = self.found();
        self.diags.push(missing(&dims, found));
        if line_ends {
            Ok(dims)
        } else {
            Err(Failed)
        }
    }

    /// A variable whose size could not be read (already reported): skips
    /// the rest of it, up to the next `,` of its list or the next statement.
    fn broken_decl(&mut self, kind: DeclKind, name: Ident, nesting: usize) -> VarDecl {
        self.skip_rest_of_decl(nesting);
        VarDecl { kind, span: name.span, name, dims: Vec::new(), init: None }
    }

    /// Skips to the `,` before the next variable of a declaration list (and
    /// past it), or to the next statement. `nesting` is the number of
    /// brackets already open (1 inside `x[...`).
    fn skip_rest_of_decl(&mut self, mut nesting: usize) {
        self.silently(|p| p.skip_decl_tokens(&mut nesting));
    }

    fn skip_decl_tokens(&mut self, nesting: &mut usize) {
        loop {
            match self.peek_token() {
                Token::Eof | Token::RBrace => return,
                Token::Input | Token::State | Token::Param | Token::Rate | Token::Let | Token::Output => {
                    return
                }
                Token::Cell | Token::Fn | Token::Const => return,
                Token::Ident if self.peek2().token == Token::Prime => return,
                Token::Comma if *nesting == 0 => {
                    self.list_continues = true;
                    self.bump();
                    return;
                }
                Token::LBracket | Token::LParen => *nesting += 1,
                Token::RBracket | Token::RParen => *nesting = nesting.saturating_sub(1),
                _ => {}
            }
            self.bump();
        }
    }

    /// An initialiser after `=`; `None` if it is not one (reported, and
    /// skipped up to the next variable of the list).
    fn init(&mut self) -> Option<Init> {
        let l = self.peek();
        if l.token == Token::Number {
            let text = self.text(l.span).to_string();
            self.diags.push(
                Diagnostic::error(l.span, format!("expected an initialiser, found the number `{text}`"))
                    .with_label(format!("write `constant({text})`"))
                    .with_note("initialisers are `zeros`, `ones`, `uniform(bound)` and `constant(value)`"),
            );
            self.bump();
            return None;
        }
        let Ok(id) = self.ident("an initialiser (`zeros`, `ones`, `uniform(...)`, `constant(...)`)") else {
            self.skip_rest_of_decl(0);
            return None;
        };
        match id.name.as_str() {
            "zeros" => Some(Init::Zeros(id.span)),
            "ones" => Some(Init::Ones(id.span)),
            "uniform" | "constant" => {
                if self.expect(Token::LParen).is_err() {
                    self.skip_rest_of_decl(0);
                    return None;
                }
                let parsed = self.expr().and_then(|e| Ok((e, self.expect(Token::RParen)?)));
                let Ok((e, close)) = parsed else {
                    self.skip_rest_of_decl(1);
                    return None;
                };
                let span = id.span.to(close.span);
                Some(if id.name == "uniform" { Init::Uniform(e, span) } else { Init::Constant(e, span) })
            }
            other => {
                self.diags.push(
                    Diagnostic::error(id.span, format!("unknown initialiser `{other}`"))
                        .with_label("not an initialiser")
                        .with_note("expected `zeros`, `ones`, `uniform(bound)` or `constant(value)`"),
                );
                self.skip_parens();
                None
            }
        }
    }

    /// `dim := dim (+|-) dim | dim * dim | (dim) | INTEGER | NAME`
    fn dim(&mut self, depth: u32) -> PResult<DimExpr> {
        let (mut lhs, mut d) = self.dim_term(depth)?;
        loop {
            let op = match self.peek_token() {
                Token::Plus => DimOp::Add,
                Token::Minus => DimOp::Sub,
                _ => return Ok(lhs),
            };
            let op_span = self.bump().span;
            d += 1;
            if d > MAX_TREE_DEPTH {
                return Err(self.too_long(op_span));
            }
            let (rhs, rd) = self.dim_term(depth)?;
            d = d.max(rd + 1);
            let span = lhs.span().to(rhs.span());
            lhs = DimExpr::Binary { op, lhs: Box::new(lhs), rhs: Box::new(rhs), span };
        }
    }

    fn dim_term(&mut self, depth: u32) -> PResult<(DimExpr, u32)> {
        let (mut lhs, mut d) = (self.dim_atom(depth)?, 1);
        while let Some(star) = self.eat(Token::Star) {
            d += 1;
            if d > MAX_TREE_DEPTH {
                return Err(self.too_long(star.span));
            }
            let rhs = self.dim_atom(depth)?;
            let span = lhs.span().to(rhs.span());
            lhs = DimExpr::Binary { op: DimOp::Mul, lhs: Box::new(lhs), rhs: Box::new(rhs), span };
        }
        Ok((lhs, d))
    }

    fn dim_atom(&mut self, depth: u32) -> PResult<DimExpr> {
        let l = self.peek();
        match l.token {
            Token::Number => {
                self.bump();
                let text = self.text(l.span);
                match text.parse::<u64>() {
                    Ok(n) => Ok(DimExpr::Int(n, l.span)),
                    Err(_) if text.bytes().all(|b| b.is_ascii_digit()) => {
                        self.diags.push(
                            Diagnostic::error(l.span, "dimension is too large")
                                .with_label("does not fit in 64 bits"),
                        );
                        Err(Failed)
                    }
                    Err(_) => {
                        self.diags.push(
                            Diagnostic::error(l.span, format!("dimension `{text}` is not a whole number"))
                                .with_label("expected an integer"),
                        );
                        Err(Failed)
                    }
                }
            }
            Token::Ident => Ok(DimExpr::Var(self.ident("a size")?)),
            Token::LParen => {
                self.bump();
                if depth + 1 > MAX_DEPTH {
                    return Err(self.too_deep(l.span));
                }
                let d = self.dim(depth + 1)?;
                self.expect(Token::RParen)?;
                Ok(d)
            }
            _ => Err(self.expected("a size (a whole number or a size variable like `H`)")),
        }
    }

    // ---- statements -----------------------------------------------------

    fn let_stmt(&mut self) -> PResult<Let> {
        let kw = self.expect(Token::Let)?;
        let mut names = vec![self.binding_name()?];
        while self.eat(Token::Comma).is_some() {
            names.push(self.binding_name()?);
        }
        if let Some(l) = self.eat(Token::Prime) {
            self.diags.push(
                Diagnostic::error(l.span, "a `let` name cannot be primed").with_note(
                    "only states have primed values; update a state with `NAME' = ...` (no `let`)",
                ),
            );
            return Err(Failed);
        }
        if self.eat(Token::Eq).is_none() {
            // `let a b + c`: the value is there, only the `=` is missing.
            let starts_value = match self.peek_token() {
                Token::Number | Token::MalformedNumber | Token::LParen | Token::Minus => true,
                Token::Ident => !matches!(self.peek2().token, Token::Eq | Token::Comma),
                _ => false,
            };
            self.expected("`=`");
            if !starts_value {
                // Keep the names bound, with no value.
                self.recover_to_stmt();
                let span = kw.span.to(names[names.len() - 1].span);
                return Ok(Let { names, value: Expr::error(span), span });
            }
        }
        let value = self.stmt_value();
        self.eat(Token::Semi);
        Ok(Let { span: kw.span.to(value.span), names, value })
    }

    /// A name a `let` binds. A keyword is reported, then accepted as the
    /// name (and as a name wherever it is read later), so that the mistake
    /// is reported once.
    fn binding_name(&mut self) -> PResult<Ident> {
        let l = self.peek();
        if l.token.is_keyword() && matches!(self.peek2().token, Token::Eq | Token::Comma) {
            let word = self.text(l.span).to_string();
            self.diags.push(
                Diagnostic::error(l.span, format!("`{word}` is a keyword and cannot be used as a name"))
                    .with_label("choose another name")
                    .with_note("the keywords are `cell fn const let input state param rate output`"),
            );
            self.bump();
            self.keyword_names.insert(word.clone());
            return Ok(Ident { name: word, span: l.span });
        }
        self.ident("a name to bind")
    }

    fn assign_stmt(&mut self) -> PResult<Stmt> {
        let state = self.ident("a state name")?;
        let prime = self.expect(Token::Prime)?;
        self.check_prime_adjacent(&state, prime.span);
        self.expect(Token::Eq)?;
        let value = self.stmt_value();
        self.eat(Token::Semi);
        Ok(Stmt::Assign { span: state.span.to(value.span), state, value })
    }

    /// `NAME = expr`, with neither `let` nor `'`: read as what it most
    /// likely means, so that the rest of the cell is checked as intended.
    fn bare_assignment(&mut self, decls: &[VarDecl], stmts: &[Stmt]) -> PResult<Option<Stmt>> {
        let name = self.ident("a name")?;
        let eq = self.expect(Token::Eq)?;
        let n = &name.name;
        let declared = decls.iter().find(|d| d.name.name == *n).map(|d| d.kind);
        let bound = stmts.iter().any(|s| matches!(s, Stmt::Let(l) if l.names.iter().any(|b| b.name == *n)));
        let (d, stmt) = match declared {
            Some(DeclKind::State) => (
                Diagnostic::error(name.span, format!("missing `'` in the update of state `{n}`"))
                    .with_label(format!("write `{n}'` here"))
                    .with_note(format!(
                        "`{n}` is the state's value at the start of the step; `{n}' = ...` gives its new value"
                    )),
                Some(true),
            ),
            Some(kind) => (
                Diagnostic::error(name.span, format!(
                    "cannot assign to `{n}`: it is declared as {}",
                    if kind == DeclKind::Input { "an input" } else { "a parameter" }
                ))
                    .with_label("names cannot be reassigned")
                    .with_note("bind the new value to a new name with `let`; only states are updated, with `NAME' = ...`"),
                None,
            ),
            None if bound => (
                Diagnostic::error(name.span, format!("cannot assign to `{n}` again"))
                    .with_label("already bound by a `let` above")
                    .with_note("`let` bindings are immutable: bind the new value to a new name"),
                None,
            ),
            None => (
                Diagnostic::error(name.span, format!("missing `let` before `{n}`"))
                    .with_label(format!("write `let {n} = ...`"))
                    .with_note(format!("to update a state, declare it with `state {n}[...]` and write `{n}' = ...`")),
                Some(false),
            ),
        };
        self.diags.push(d);
        let value = self.stmt_value();
        self.eat(Token::Semi);
        let span = name.span.to(eq.span).to(value.span);
        Ok(match stmt {
            Some(true) => Some(Stmt::Assign { state: name, value, span }),
            Some(false) => Some(Stmt::Let(Let { names: vec![name], value, span })),
            None => None,
        })
    }

    /// A statement's value. On a syntax error it skips the rest of the
    /// statement and stands in an error node, so that the statement (the
    /// names it binds, the state it updates) is kept.
    fn stmt_value(&mut self) -> Expr {
        let start = self.peek().span;
        match self.expr() {
            Ok(e) => e,
            Err(Failed) => {
                self.recover_to_stmt();
                Expr::error(start)
            }
        }
    }

    fn output_stmt(&mut self) -> PResult<Stmt> {
        let kw = self.expect(Token::Output)?;
        let value = self.stmt_value();
        self.eat(Token::Semi);
        Ok(Stmt::Output { span: kw.span.to(value.span), value })
    }

    fn check_prime_adjacent(&mut self, name: &Ident, prime: Span) {
        if prime.start != name.span.end {
            self.diags.push(
                Diagnostic::error(prime, format!("`'` must follow `{}` directly", name.name))
                    .with_label("remove the space before `'`"),
            );
        }
    }

    /// The `)` matching `open`. Missing at the end of a line, it is
    /// reported there, not at the next line's first token.
    fn close_paren(&mut self, open: Span, expected: &str) -> PResult<Lexeme> {
        if let Some(close) = self.eat(Token::RParen) {
            return Ok(close);
        }
        if self.pos == 0 || !self.starts_line(self.pos) || self.after_unreadable() {
            return Err(self.expected(expected));
        }
        let prev = self.tokens[self.pos - 1].span;
        self.diags.push(
            Diagnostic::error(prev, "expected `)` before the end of the line")
                .with_label("expected `)` after this")
                .with_secondary(open, "to close this `(`"),
        );
        Err(Failed)
    }

    fn number_value(&mut self, span: Span) -> PResult<f64> {
        let text = self.text(span);
        let v: f64 = text.parse().map_err(|_| Failed)?;
        if !v.is_finite() || v.abs() > f32::MAX as f64 {
            self.diags.push(
                Diagnostic::error(span, format!("number `{text}` is too large"))
                    .with_label("does not fit in an f32")
                    .with_note(format!("the largest f32 is about {:e}", f32::MAX)),
            );
            return Err(Failed);
        }
        Ok(v)
    }

    // ---- expressions ----------------------------------------------------

    pub fn expr(&mut self) -> PResult<Expr> {
        self.comparison(0).map(|(e, _)| e)
    }

    /// A sum, or two sums compared (`a < b`): comparisons bind loosest
    /// and do not chain.
    fn comparison(&mut self, depth: u32) -> PResult<(Expr, u32)> {
        let (lhs, d) = self.sum(depth)?;
        let Some(op) = comparison_op(self.peek_token()) else { return Ok((lhs, d)) };
        let op_span = self.bump().span;
        let (rhs, rd) = self.sum(depth)?;
        let d = d.max(rd) + 1;
        if d > MAX_TREE_DEPTH {
            return Err(self.too_long(op_span));
        }
        if comparison_op(self.peek_token()).is_some() {
            let second = self.peek().span;
            self.diags.push(
                Diagnostic::error(second, "comparisons do not chain")
                    .with_label(format!("a second comparison after this `{}`", op.symbol()))
                    .with_secondary(op_span, "the first comparison")
                    .with_note("compare two values at a time; join conditions with `*` (and) or `max` (or)"),
            );
            return Err(Failed);
        }
        Ok((binary(op, lhs, rhs), d))
    }

    /// `+` and `-`, left-associative. Returns the tree's depth with it.
    fn sum(&mut self, depth: u32) -> PResult<(Expr, u32)> {
        let (mut lhs, mut d) = self.product(depth)?;
        loop {
            let op = match self.peek_token() {
                Token::Plus => BinOp::Add,
                Token::Minus => BinOp::Sub,
                _ => return Ok((lhs, d)),
            };
            let op_span = self.bump().span;
            let (rhs, rd) = self.product(depth)?;
            d = d.max(rd) + 1;
            if d > MAX_TREE_DEPTH {
                return Err(self.too_long(op_span));
            }
            lhs = binary(op, lhs, rhs);
        }
    }

    fn product(&mut self, depth: u32) -> PResult<(Expr, u32)> {
        let (mut lhs, mut d) = self.unary(depth)?;
        loop {
            let op = match self.peek_token() {
                Token::Star => BinOp::Mul,
                Token::Slash => BinOp::Div,
                _ => return Ok((lhs, d)),
            };
            let op_span = self.bump().span;
            let (rhs, rd) = self.unary(depth)?;
            d = d.max(rd) + 1;
            if d > MAX_TREE_DEPTH {
                return Err(self.too_long(op_span));
            }
            lhs = binary(op, lhs, rhs);
        }
    }

    fn unary(&mut self, depth: u32) -> PResult<(Expr, u32)> {
        if let Some(minus) = self.eat(Token::Minus) {
            if depth + 1 > MAX_DEPTH {
                return Err(self.too_deep(minus.span));
            }
            let (e, d) = self.unary(depth + 1)?;
            let span = minus.span.to(e.span);
            return Ok((Expr { kind: ExprKind::Neg(Box::new(e)), span }, d + 1));
        }
        self.matmul(depth)
    }

    fn matmul(&mut self, depth: u32) -> PResult<(Expr, u32)> {
        let (mut lhs, mut d) = self.primary(depth)?;
        while let Some(at) = self.eat(Token::At) {
            let (rhs, rd) = self.primary(depth)?;
            d = d.max(rd) + 1;
            if d > MAX_TREE_DEPTH {
                return Err(self.too_long(at.span));
            }
            lhs = binary(BinOp::MatMul, lhs, rhs);
        }
        Ok((lhs, d))
    }

    fn primary(&mut self, depth: u32) -> PResult<(Expr, u32)> {
        let l = self.peek();
        match l.token {
            Token::Number => {
                self.bump();
                let kind = match self.number_value(l.span) {
                    Ok(v) => ExprKind::Number(v),
                    // Reported; the expression around it still parses.
                    Err(Failed) => ExprKind::Error,
                };
                Ok((Expr { kind, span: l.span }, 1))
            }
            Token::MalformedNumber => {
                // Reported by the lexer; read it as an operand of unknown value.
                self.bump();
                Ok((Expr::error(l.span), 1))
            }
            t if t.is_keyword() && self.keyword_names.contains(self.text(l.span)) => {
                // A keyword a `let` bound (reported there): read it as that name.
                self.bump();
                let id = Ident { name: self.text(l.span).to_string(), span: l.span };
                Ok((Expr { kind: ExprKind::Name(id), span: l.span }, 1))
            }
            Token::Ident => {
                let id = self.ident("a name")?;
                match self.peek_token() {
                    Token::Prime => {
                        let prime = self.bump().span;
                        self.check_prime_adjacent(&id, prime);
                        let span = id.span.to(prime);
                        Ok((Expr { kind: ExprKind::Primed(id), span }, 1))
                    }
                    Token::LParen => {
                        let open = self.bump().span;
                        if depth + 1 > MAX_DEPTH {
                            return Err(self.too_deep(l.span));
                        }
                        let mut args = Vec::new();
                        let mut d = 0;
                        if self.peek_token() != Token::RParen {
                            loop {
                                let (a, ad) = self.comparison(depth + 1)?;
                                d = d.max(ad);
                                args.push(a);
                                if self.eat(Token::Comma).is_none() {
                                    break;
                                }
                            }
                        }
                        let close = self.close_paren(open, "`,` or `)` in the argument list")?;
                        let span = id.span.to(close.span);
                        Ok((Expr { kind: ExprKind::Call { callee: id, args }, span }, d + 1))
                    }
                    _ => {
                        let span = id.span;
                        Ok((Expr { kind: ExprKind::Name(id), span }, 1))
                    }
                }
            }
            Token::LParen => {
                self.bump();
                if depth + 1 > MAX_DEPTH {
                    return Err(self.too_deep(l.span));
                }
                let (e, d) = self.comparison(depth + 1)?;
                let close = self.close_paren(l.span, "`)`")?;
                let span = l.span.to(close.span);
                Ok((Expr { kind: ExprKind::Paren(Box::new(e)), span }, d + 1))
            }
            _ => {
                // `a +` ending a line: the operator is what is wrong, not the next line.
                let prev = self.tokens[self.pos.saturating_sub(1)];
                let dangling = matches!(
                    prev.token,
                    Token::Plus
                        | Token::Minus
                        | Token::Star
                        | Token::Slash
                        | Token::At
                        | Token::Eq
                        | Token::EqEq
                        | Token::NotEq
                        | Token::Less
                        | Token::LessEq
                        | Token::Greater
                        | Token::GreaterEq
                );
                if dangling && self.pos > 0 && self.starts_line(self.pos) {
                    let op = self.text(prev.span).to_string();
                    self.diags.push(
                        Diagnostic::error(prev.span, format!("expected an expression after `{op}`"))
                            .with_label(format!("nothing follows this `{op}` on its line")),
                    );
                    return Err(Failed);
                }
                Err(self.expected("an expression"))
            }
        }
    }
}

/// The comparison a token writes, if it writes one.
fn comparison_op(token: Token) -> Option<BinOp> {
    Some(match token {
        Token::Less => BinOp::Lt,
        Token::LessEq => BinOp::Le,
        Token::Greater => BinOp::Gt,
        Token::GreaterEq => BinOp::Ge,
        Token::EqEq => BinOp::Eq,
        Token::NotEq => BinOp::Ne,
        _ => return None,
    })
}

fn binary(op: BinOp, lhs: Expr, rhs: Expr) -> Expr {
    let span = lhs.span.to(rhs.span);
    Expr { kind: ExprKind::Binary { op, lhs: Box::new(lhs), rhs: Box::new(rhs) }, span }
}

fn stmt_span(s: &Stmt) -> Span {
    match s {
        Stmt::Let(l) => l.span,
        Stmt::Assign { span, .. } | Stmt::Output { span, .. } => *span,
    }
}

fn late_result(e: &Expr) -> Diagnostic {
    Diagnostic::error(e.span, "only the last expression of a function body is its result")
        .with_label("this expression is not the last")
        .with_note("bind intermediate values with `let`")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_ok(src: &str) -> File {
        let (f, d) = parse(FileId(0), src);
        assert!(!d.has_errors(), "{d:?}");
        f
    }

    #[test]
    fn precedence_matmul_binds_tightest() {
        let f = parse_ok("cell c { input x[I] state h[H] param W[H, I]\n output -W @ x * 2 + h }");
        let Item::Cell(c) = &f.items[0] else { panic!() };
        let Stmt::Output { value, .. } = &c.stmts[0] else { panic!() };
        // ((-(W @ x)) * 2) + h
        let ExprKind::Binary { op: BinOp::Add, lhs, .. } = &value.kind else { panic!("{value:?}") };
        let ExprKind::Binary { op: BinOp::Mul, lhs: neg, .. } = &lhs.kind else { panic!() };
        let ExprKind::Neg(inner) = &neg.kind else { panic!() };
        assert!(matches!(inner.kind, ExprKind::Binary { op: BinOp::MatMul, .. }));
    }

    #[test]
    fn statements_need_no_separator() {
        let f = parse_ok("cell c { input x[I] state h[H]\n let a = x\n h' = a\n output h' }");
        let Item::Cell(c) = &f.items[0] else { panic!() };
        assert_eq!(c.stmts.len(), 3);
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let src = format!(
            "cell c {{ input x[I] state h[H] h' = {}x{} output h' }}",
            "(".repeat(100_000),
            ")".repeat(100_000)
        );
        let (_, d) = parse(FileId(0), &src);
        assert!(d.iter().any(|d| d.message.contains("nested too deeply")));
        // A flat chain is not nesting: 2,000 terms parse; past the length limit it is an error of its own.
        let chain = |terms: usize| {
            format!("cell c {{ input x[I] state h[H] h' = x{} output h' }}", " + x".repeat(terms))
        };
        let (_, d) = parse(FileId(0), &chain(2_000));
        assert!(!d.has_errors(), "{d:?}");
        let (_, d) = parse(FileId(0), &chain(100_000));
        assert!(d.iter().any(|d| d.message.contains("too long")));
        assert!(!d.iter().any(|d| d.message.contains("nested")));
    }

    #[test]
    fn several_errors_reported() {
        let (_, d) = parse(FileId(0), "cell c { let = 1\n let b = * 2\n output }");
        assert_eq!(d.error_count(), 3, "{d:?}");
    }
}
