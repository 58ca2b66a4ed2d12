//! JUnit XML for CI systems: one testsuite per run, one testcase per scenario.

use super::Report;

fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            // XML 1.0 cannot carry most control characters, even escaped.
            c if (c as u32) < 0x20 && !matches!(c, '\t' | '\n' | '\r') => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

impl Report {
    /// The report as JUnit XML.
    pub fn junit(&self) -> String {
        let (_, failures, skipped) = self.totals();
        let seconds = self.millis as f64 / 1000.0;
        let suite = escape(&format!("broker provider test: {} {}", self.provider, self.version));
        let class = escape(&format!("conformance.{}", self.provider));
        let mut xml = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        xml.push_str(&format!(
            "<testsuites tests=\"{n}\" failures=\"{failures}\" time=\"{seconds:.3}\">\n  \
             <testsuite name=\"{suite}\" tests=\"{n}\" failures=\"{failures}\" errors=\"0\" skipped=\"{skipped}\" time=\"{seconds:.3}\">\n",
            n = self.cases.len()
        ));
        // A CI system keys testcases by name: the kit's are unique, and should
        // one ever repeat, its later runs are numbered rather than merged.
        let mut seen = std::collections::BTreeMap::<&str, usize>::new();
        for case in &self.cases {
            let times = seen.entry(case.name.as_ref()).or_default();
            *times += 1;
            let name = match *times {
                1 => escape(&case.name),
                n => escape(&format!("{} ({n})", case.name)),
            };
            let detail = escape(&case.detail);
            if case.skipped {
                xml.push_str(&format!(
                    "    <testcase classname=\"{class}\" name=\"{name}\"><skipped message=\"{detail}\"/></testcase>\n"
                ));
            } else if case.passed {
                xml.push_str(&format!(
                    "    <testcase classname=\"{class}\" name=\"{name}\"><system-out>{detail}</system-out></testcase>\n"
                ));
            } else {
                // The failure's body: the reason, then the host calls of the case.
                let body: Vec<String> =
                    std::iter::once(detail.clone()).chain(case.trace.iter().map(|c| escape(c))).collect();
                let body = body.join("\n");
                xml.push_str(&format!(
                    "    <testcase classname=\"{class}\" name=\"{name}\"><failure message=\"{detail}\">{body}</failure></testcase>\n"
                ));
            }
        }
        xml.push_str("  </testsuite>\n</testsuites>\n");
        xml
    }
}

#[cfg(test)]
mod tests {
    use super::super::Case;
    use super::*;

    #[test]
    fn cases_become_testcases_and_text_is_escaped() {
        let report = Report {
            provider: "p<1>".into(),
            version: "0.1".into(),
            cases: vec![
                Case {
                    name: "describe".into(),
                    passed: true,
                    detail: "name and version set".into(),
                    trace: Vec::new(),
                    skipped: false,
                },
                Case {
                    name: "double stop is ok".into(),
                    passed: false,
                    detail: "not run: start-instance failed".into(),
                    trace: Vec::new(),
                    skipped: true,
                },
                Case {
                    name: "stop-unknown".into(),
                    passed: false,
                    detail: "returned \"not-found\" & <more>\u{1}".into(),
                    trace: vec!["kv.get(key=\"a\") -> Ok(None)".into()],
                    skipped: false,
                },
            ],
            millis: 1234,
            redactor: Default::default(),
        };
        let xml = report.junit();
        assert!(xml.contains("<testsuites tests=\"3\" failures=\"1\" time=\"1.234\">"), "{xml}");
        assert!(xml.contains("skipped=\"1\""), "{xml}");
        assert!(
            xml.contains("name=\"double stop is ok\"><skipped message=\"not run: start-instance failed\"/>"),
            "{xml}"
        );
        assert!(report.text().ends_with("1 passed, 1 failed, 1 skipped (1234 ms)\n"), "{}", report.text());
        assert!(report.text().contains("skip double stop is ok"), "{}", report.text());
        assert!(xml.contains("name=\"broker provider test: p&lt;1&gt; 0.1\""), "{xml}");
        assert!(xml.contains(
            "name=\"stop-unknown\"><failure message=\"returned &quot;not-found&quot; &amp; &lt;more&gt;\u{FFFD}\""
        ));
        assert!(xml.contains("\nkv.get(key=&quot;a&quot;) -&gt; Ok(None)</failure>"), "the host calls follow: {xml}");
        assert!(xml.contains("name=\"describe\"><system-out>name and version set</system-out>"));
        assert_eq!(xml.matches("<testcase ").count(), 3);
        assert!(xml.ends_with("</testsuites>\n"));
    }
}
