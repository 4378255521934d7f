#pragma once
// Output of the a2a3 cost model: a JSON summary of kernel reports and the per-core timeline as
// Chrome trace JSON (chrome://tracing, https://ui.perfetto.dev): one process per core (AIC<i> /
// AIV<i>), one thread per pipe, one "X" event per issued op, plus a "launches" process with one
// event per launch (its overhead included), all in microseconds.

#include <cstdint>
#include <cstdio>
#include <map>
#include <ostream>
#include <sstream>
#include <string>
#include <string_view>

#include "tiledecode/backend/a2a3/machine.hpp"
#include "tiledecode/backend/a2a3/memory.hpp"

namespace tiledecode::a2a3 {

namespace detail {
inline std::string json_escape(std::string_view s) {
  std::string r;
  for (char c : s) {
    if (c == '"' || c == '\\') r += '\\';
    r += c;
  }
  return r;
}
inline std::string num(double v) {
  char b[64];
  std::snprintf(b, sizeof b, "%.4f", v);
  return b;
}
}  // namespace detail

// {"gm_read":..,"gm_write":..,"ring":..,"l1_in":..,...}
inline std::string traffic_json(const Traffic& t) {
  std::ostringstream o;
  o << "{\"gm_read\":" << t.gm_read << ",\"gm_write\":" << t.gm_write << ",\"ring\":" << t.ring
    << ",\"l1_in\":" << t.l1_in << ",\"l0a_in\":" << t.l0a_in << ",\"l0b_in\":" << t.l0b_in
    << ",\"l0c_out\":" << t.l0c_out << ",\"ub_in\":" << t.ub_in << ",\"ub_out\":" << t.ub_out
    << "}";
  return o.str();
}

inline std::string pipes_json(const std::array<double, kPipes>& us) {
  std::ostringstream o;
  o << "{";
  for (int p = 0; p < kPipes; ++p)
    o << (p ? "," : "") << "\"" << pipe_name(Pipe(p)) << "\":" << detail::num(us[std::size_t(p)]);
  o << "}";
  return o.str();
}

// One kernel report as a JSON object: latency, traffic, per-launch details (per-pipe busy time
// of the slowest core and max over cores, peak occupancy per space, per-core peaks).
inline std::string kernel_json(const KernelReport& k) {
  std::ostringstream o;
  o << "{\"name\":\"" << detail::json_escape(k.name)
    << "\",\"latency_us\":" << detail::num(k.latency_us())
    << ",\"traffic\":" << traffic_json(k.traffic())
    << ",\"busy_slowest_us\":" << pipes_json(k.busy_slowest_us()) << ",\"launches\":[";
  bool first = true;
  for (const auto& l : k.launches) {
    o << (first ? "" : ",") << "{\"name\":\"" << detail::json_escape(l.name)
      << "\",\"blocks\":" << l.blocks << ",\"latency_us\":" << detail::num(l.latency_us)
      << ",\"core_us\":" << detail::num(l.core_us)
      << ",\"hbm_bound_us\":" << detail::num(l.hbm_bound_us) << ",\"slowest_core\":\""
      << l.slowest_core << "\",\"busy_slowest_us\":" << pipes_json(l.busy_slowest_us)
      << ",\"busy_max_us\":" << pipes_json(l.busy_max_us) << ",\"peak_bytes\":{";
    for (int s = 1; s < kLocalSpaces; ++s)
      o << (s > 1 ? "," : "") << "\"" << space_name(Space(s))
        << "\":" << l.peak_max[std::size_t(s)];
    o << "},\"peak_bytes_per_core\":{";
    bool fc = true;
    for (const auto& cp : l.peaks) {
      o << (fc ? "" : ",") << "\"" << cp.core << "\":[";
      for (int s = 1; s < kLocalSpaces; ++s) o << (s > 1 ? "," : "") << cp.peak[std::size_t(s)];
      o << "]";
      fc = false;
    }
    o << "},\"traffic\":" << traffic_json(l.traffic) << "}";
    first = false;
  }
  o << "]}";
  return o.str();
}

// Writes the Chrome trace of everything `m` recorded with tracing on.
inline void write_chrome_trace(std::ostream& os, const Machine& m) {
  std::map<std::string, int> pid;  // core name -> pid (1..), 0 = launches
  auto pid_of = [&](const std::string& core) {
    auto it = pid.find(core);
    if (it != pid.end()) return it->second;
    const int id = int(pid.size()) + 1;
    pid.emplace(core, id);
    return id;
  };
  std::ostringstream ev;
  bool first = true;
  auto sep = [&] {
    if (!first) ev << ",\n";
    first = false;
  };
  for (const auto& e : m.trace()) {
    sep();
    ev << "{\"name\":\"" << detail::json_escape(e.name) << "\",\"cat\":\""
       << detail::json_escape(e.launch) << "\",\"ph\":\"X\",\"ts\":" << detail::num(e.ts_us)
       << ",\"dur\":" << detail::num(e.dur_us) << ",\"pid\":" << pid_of(e.core)
       << ",\"tid\":" << int(e.pipe) << "}";
  }
  for (const auto& l : m.launch_spans()) {
    sep();
    ev << "{\"name\":\"" << detail::json_escape(l.name)
       << "\",\"cat\":\"launch\",\"ph\":\"X\",\"ts\":" << detail::num(l.ts_us)
       << ",\"dur\":" << detail::num(l.dur_us) << ",\"pid\":0,\"tid\":0}";
  }
  sep();
  ev << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":0,\"args\":{\"name\":\"launches\"}}";
  for (const auto& [core, id] : pid) {
    sep();
    ev << "{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":" << id << ",\"args\":{\"name\":\""
       << core << "\"}}";
    sep();
    ev << "{\"name\":\"process_sort_index\",\"ph\":\"M\",\"pid\":" << id
       << ",\"args\":{\"sort_index\":" << (core[2] == 'C' ? 0 : 1000) + std::stoi(core.substr(3))
       << "}}";
    for (int p = 0; p < kPipes; ++p) {
      sep();
      ev << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":" << id << ",\"tid\":" << p
         << ",\"args\":{\"name\":\"" << pipe_name(Pipe(p)) << "\"}}";
    }
  }
  os << "{\"displayTimeUnit\":\"ns\",\"traceEvents\":[\n" << ev.str() << "\n]}\n";
}

}  // namespace tiledecode::a2a3
