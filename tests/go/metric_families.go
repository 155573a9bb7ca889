// Reads a Prometheus text exposition on stdin with Go's expfmt, the parser
// upstream's integration suite and Prometheus' Go tooling use, and prints
// one JSON object per family as that parser sees it: name, type, help, the
// label names of its samples, and how many samples it has. A sample whose
// name does not match its TYPE line lands in a family of its own, untyped
// and without help, exactly as it would for a scraper.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"sort"

	"github.com/prometheus/common/expfmt"
)

type family struct {
	Name    string     `json:"name"`
	Type    string     `json:"type"`
	Help    string     `json:"help"`
	Labels  [][]string `json:"labels"`
	Samples int        `json:"samples"`
}

func main() {
	var parser expfmt.TextParser
	families, err := parser.TextToMetricFamilies(os.Stdin)
	if err != nil {
		fmt.Fprintln(os.Stderr, "expfmt:", err)
		os.Exit(1)
	}
	names := make([]string, 0, len(families))
	for name := range families {
		names = append(names, name)
	}
	sort.Strings(names)
	out := json.NewEncoder(os.Stdout)
	for _, name := range names {
		mf := families[name]
		f := family{Name: name, Type: mf.GetType().String(), Help: mf.GetHelp(), Samples: len(mf.GetMetric())}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, pair := range m.GetLabel() {
				labels = append(labels, pair.GetName())
			}
			f.Labels = append(f.Labels, labels)
		}
		out.Encode(f)
	}
}
