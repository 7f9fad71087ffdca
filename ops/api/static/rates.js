// Throughput over a window of committed steps: the rule of shoal.core.throughput.rolling_rates
// (core/throughput.py), which `shoal status`, the report and TensorBoard use. At each point,
// the steps gained since the oldest point at most `windowS` seconds before it (the point just
// before it when that one is farther: steps slower than the window), over the time between
// them; a step that went back (a resume from an older checkpoint) gains nothing. tests/api/
// test_rates_js.py runs this file in node against the Python function.
"use strict";

function windowRates(tMs, steps, windowS) {
  const out = [];
  const gained = [0];
  for (let k = 1; k < steps.length; k++) gained.push(gained[k - 1] + Math.max(0, steps[k] - steps[k - 1]));
  let lo = 0;
  for (let end = 0; end < steps.length; end++) {
    while (lo < end && (tMs[end] - tMs[lo]) / 1000 > windowS) lo++;
    const start = end > 0 ? Math.min(lo, end - 1) : 0;
    const span = (tMs[end] - tMs[start]) / 1000;
    out.push(end > 0 && span > 0 ? (gained[end] - gained[start]) / span : null);
  }
  return out;
}

if (typeof window !== "undefined") window.windowRates = windowRates;
if (typeof module !== "undefined") module.exports = { windowRates };
