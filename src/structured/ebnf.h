// EBNF grammars (SGLang's `ebnf`, vLLM's `guided_grammar`, in the GBNF / xgrammar notation) as a regular expression
// (structured/regex.h) for constrained decoding. Rules `name ::= body`; a body is alternatives (`|`) of sequences of
// "strings" (escapes \n \t \r \\ \" \xHH \uHHHH), [character classes] (regex syntax), rule names and ( groups ), each
// optionally repeated (`*`, `+`, `?`, `{m}`, `{m,}`, `{m,n}`); `#` starts a comment; a rule's body may span lines. The
// text is the rule `root`. A rule that refers to itself (directly or through others) is followed kRefDepth times
// along one path, then ended where the grammar allows (an alternative without it, a repeat taken zero times), as
// recursive JSON schemas are (json_schema.h); a regex past kMaxRegexBytes is an error. Lark's notation is read too
// when the first statement is `name:` / `?name:` / a `%` directive (vLLM's guided_grammar takes it): the text is the
// rule `start`; "strings" ("..."i any case, "a".."z" ranges), /regexes/ (no flags), [optional] items, `~ n..m`,
// `-> alias`, // comments, `%import common.NAME` (Lark's common terminals), `%ignore ITEM` (what it matches may stand
// before, after and between any two elements of the rules -- not inside terminals: upper-case names, strings,
// regexes -- as Lark's lexer skips it); templates are errors.
#pragma once

#include <string>
#include <string_view>

namespace mlaserve::structured {

// Throws mlaserve::Error naming the line for a syntax error, an undefined rule, a missing root or a grammar with no
// text within the recursion bound.
std::string ebnf_regex(std::string_view grammar);

}  // namespace mlaserve::structured
