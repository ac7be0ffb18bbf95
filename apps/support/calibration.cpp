// apps/support/calibration.cpp: the device's rates from the cache or measured, the link's measured.
#include "apps/support/calibration.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "dist/comm/agreement.h"
#include "dist/comm/monitor.h"

namespace shardlab::apps {
namespace {

constexpr DType kMeasuredDtypes[] = {DType::f32, DType::bf16, DType::f16};

nlohmann::json table_json(const DenseRates& table) {
  nlohmann::json json = nlohmann::json::object();
  for (const auto& [dtype, sizes] : table) {
    for (const DenseRate& size : sizes)
      json[std::string(dtype_name(dtype))].push_back({size.flops, size.per_second});
  }
  return json;
}

DenseRates table_from(const nlohmann::json& json) {
  DenseRates table;
  for (const DType dtype : kMeasuredDtypes) {
    const auto sizes = json.find(std::string(dtype_name(dtype)));
    if (sizes == json.end()) continue;
    for (const auto& size : *sizes)
      table[dtype].push_back({size.at(0).get<double>(), size.at(1).get<double>()});
  }
  return table;
}

nlohmann::json rates_json(const DeviceRates& rates) {
  nlohmann::json attention = nlohmann::json::object();
  for (const auto& [op, by_dtype] : rates.attention) {
    for (const auto& [dtype, rate] : by_dtype)
      attention[op][std::string(dtype_name(dtype))] = {rate.seconds_per_pair, rate.flops_per_second};
  }
  nlohmann::json kernels = nlohmann::json::object();
  for (const auto& [op, table] : rates.kernels) kernels[op] = table_json(table);
  return {{"device", rates.device},
          {"dense", table_json(rates.dense)},
          {"kernels", kernels},
          {"attention", attention},
          {"bytes_per_second", rates.bytes_per_second},
          {"seconds_per_call", rates.seconds_per_call},
          {"host_to_device_bytes_per_second", rates.host_to_device_bytes_per_second},
          {"device_to_host_bytes_per_second", rates.device_to_host_bytes_per_second},
          {"calls_overlap", rates.calls_overlap}};
}

DeviceRates rates_from(const nlohmann::json& json) {
  DeviceRates rates{
      .device = json.at("device").get<std::string>(),
      .dense = table_from(json.at("dense")),
      .bytes_per_second = json.at("bytes_per_second").get<double>(),
      .seconds_per_call = json.at("seconds_per_call").get<double>(),
      .host_to_device_bytes_per_second = json.at("host_to_device_bytes_per_second").get<double>(),
      .device_to_host_bytes_per_second = json.at("device_to_host_bytes_per_second").get<double>(),
      .calls_overlap = json.at("calls_overlap").get<bool>()};
  for (const auto& [op, table] : json.at("kernels").items()) rates.kernels[op] = table_from(table);
  for (const auto& [op, by_dtype] : json.at("attention").items()) {
    for (const DType dtype : kMeasuredDtypes) {
      const auto rate = by_dtype.find(std::string(dtype_name(dtype)));
      if (rate != by_dtype.end())
        rates.attention[op][dtype] = {rate->at(0).get<double>(), rate->at(1).get<double>()};
    }
  }
  return rates;
}

std::string processor() {
  std::ifstream cpuinfo("/proc/cpuinfo");
  for (std::string line; std::getline(cpuinfo, line);) {
    if (line.starts_with("model name")) return line.substr(line.find(':') + 2);
  }
  return "unknown processor";
}

// The program's build, as its file: its size and modification time.
std::string build() {
  struct stat file {};
  if (stat("/proc/self/exe", &file) != 0) return "unknown build";
  return fmt::format("{} B, modified {}", file.st_size, file.st_mtim.tv_sec);
}

nlohmann::json read_cache(const std::string& path, std::string& problem) {
  if (!std::filesystem::exists(path)) return nlohmann::json::object();
  try {
    std::ifstream in(path);
    nlohmann::json cache = nlohmann::json::parse(in);
    if (cache.is_object()) return cache;
    problem = fmt::format("{} is not a JSON object: measured again", path);
  } catch (const std::exception& error) {
    problem = fmt::format("{} could not be read ({}): measured again", path, error.what());
  }
  return nlohmann::json::object();
}

// Writes through a temporary file, so a reader never sees half a cache; "" or what went wrong.
std::string write_cache(const std::string& path, const nlohmann::json& cache) {
  try {
    std::filesystem::create_directories(std::filesystem::path(path).parent_path());
    const std::string temporary = path + ".tmp";
    {
      std::ofstream out(temporary);
      out << cache.dump(1) << '\n';
      if (!out) return fmt::format("could not write {}", temporary);
    }
    std::filesystem::rename(temporary, path);
  } catch (const std::exception& error) {
    return error.what();
  }
  return "";
}

}  // namespace

std::string calibration_cache_path() {
  if (const char* dir = std::getenv("SHARDLAB_CACHE_DIR"); dir != nullptr && *dir != '\0')
    return std::string(dir) + "/device-rates.json";
  if (const char* dir = std::getenv("XDG_CACHE_HOME"); dir != nullptr && *dir != '\0')
    return std::string(dir) + "/shardlab/device-rates.json";
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : ".") + "/.cache/shardlab/device-rates.json";
}

std::string calibration_key(dist::Communicator& comm, Device device) {
  const std::string host = dist::host_name();
  const std::vector<std::string> hosts = dist::detail::all_gather_strings(comm, host);
  const auto sharing = std::count(hosts.begin(), hosts.end(), host);
  return fmt::format("{} | {} | {} | {} rank{} on the host | {}", host, processor(), describe_device(device),
                     sharing, sharing == 1 ? "" : "s", build());
}

Calibration calibrate(dist::Communicator& comm, Device device, bool recalibrate) {
  const std::string path = calibration_cache_path(), key = calibration_key(comm, device);
  Calibration out;
  std::string problem, cached;
  nlohmann::json cache = nlohmann::json::object();
  if (comm.rank() == 0) {
    cache = read_cache(path, problem);
    if (!recalibrate && cache.contains(key)) cached = cache[key].dump();
  }
  cached = dist::detail::all_gather_strings(comm, cached).front();
  if (!cached.empty()) {
    out.device = rates_from(nlohmann::json::parse(cached));
    out.source = fmt::format("from {} (--recalibrate measures again)", path);
  } else {
    const std::string measured = rates_json(measure_rates(device)).dump();  // every rank at once
    out.device = rates_from(nlohmann::json::parse(dist::detail::all_gather_strings(comm, measured).front()));
    if (comm.rank() == 0) {
      cache[key] = rates_json(out.device);
      const std::string failed = write_cache(path, cache);
      problem += (problem.empty() ? "" : "; ") + (failed.empty() ? "" : "not kept: " + failed);
    }
    out.source = problem.empty() ? fmt::format("measured now, kept in {}", path)
                                 : fmt::format("measured now ({})", problem);
  }
  out.link = dist::measure_collectives(comm);
  return out;
}

}  // namespace shardlab::apps
